"""What `mscale ckpt convert` and `ckpt verify` show while they work: a start line on stderr
(what, from where to where, tensors and bytes), progress lines on stderr at most every
``PLAIN_EVERY_S`` off a terminal (none for a checkpoint that takes less), and the closing line on
stdout as before; with --json stdout stays one JSON document. The interval is a module setting
the tests shorten instead of sleeping."""

from __future__ import annotations

import io
import json
import re

import pytest

from mscale.cli import ckpt as ckpt_cli
from mscale.cli.ckpt import BytesLine

from tests.unit.ckpt.hostile import run_with_plan
from tests.unit.cli.test_progress_line import Tty

PROGRESS = re.compile(r"^(convert|verify): [\d.]+ [KMGT]?B of [\d.]+ [KMGT]?B \(\d+%\), "
                      r"[\d.]+ [KMGT]?B/s, \d+ s(, about \d+ s left)?$")


@pytest.fixture(scope="module")
def good(tmp_path_factory):
    """ROOT/run (checkpoints at steps 2 and 5) and ROOT/plan.yaml (dp 2)."""
    return run_with_plan(tmp_path_factory.mktemp("good"))


def _plan(good) -> str:
    return str(good.parent / "plan.yaml")


def test_convert_says_what_it_starts_and_a_tiny_one_prints_no_progress(cli, good, tmp_path):
    dst = str(tmp_path / "out")
    code, out, err = cli("ckpt", "convert", str(good), dst, "--plan", _plan(good))
    assert code == 0
    assert err.splitlines() == [f"convert: {good}/ckpt/step-000005 → {dst}, mscale at tp1 pp1 "
                                "dp2 zero1 (2 ranks): 63 tensors, 1.3 MB before compression"]
    assert re.fullmatch(rf"wrote {dst} \(mscale, 63 tensors, [\d.]+ MB on disk\) from "
                        rf"{good}/ckpt/step-000005\n"
                        rf"next: mscale train \S+ --resume {dst} --run-dir RUN trains from it "
                        r"\(under your launcher: --local N, srun or torchrun\)\n", out)


def test_with_a_short_interval_the_progress_lines_appear(cli, good, tmp_path, monkeypatch):
    """The same conversions, throttled to nothing: the lines the 5 s interval held back."""
    monkeypatch.setattr(ckpt_cli, "PLAIN_EVERY_S", 0.0)
    for name, args in (("layout", ["--plan", _plan(good)]), ("hf", ["--to-hf"])):
        code, _, err = cli("ckpt", "convert", str(good), str(tmp_path / name), *args)
        lines = err.splitlines()
        assert code == 0 and lines[0].startswith(f"convert: {good}/ckpt/step-000005 → ")
        assert len(lines) > 2 and all(PROGRESS.match(x) for x in lines[1:]), lines
        assert re.search(r"\(100%\)", lines[-1])
    code, _, err = cli("ckpt", "verify", str(tmp_path / "layout"))
    lines = err.splitlines()
    assert code == 0 and lines[0].startswith("verify: ") and len(lines) > 2
    assert all(PROGRESS.match(x) for x in lines[1:]) and "(100%)" in lines[-1]


def test_json_keeps_stdout_one_document(cli, good, tmp_path, monkeypatch):
    monkeypatch.setattr(ckpt_cli, "PLAIN_EVERY_S", 0.0)  # progress lines too: on stderr only
    hf = str(tmp_path / "hf")
    code, out, err = cli("ckpt", "convert", str(good), hf, "--to-hf", "--json")
    assert code == 0 and json.loads(out)["format"] == "hf-safetensors"
    assert err.startswith(f"convert: {good}/ckpt/step-000005 → {hf}, HF safetensors in 1 "
                          "file(s): 21 tensors, ")
    back = str(tmp_path / "run" / "ckpt" / "step-000000")
    code, out, err = cli("ckpt", "convert", hf, back, "--plan", _plan(good), "--json")
    assert code == 0 and json.loads(out)["step"] == 0
    assert err.startswith(f"convert: {hf} → {back}, mscale, model only, from HF at tp1 pp1 dp2 "
                          "zero1 (2 ranks): 21 tensors, ")
    code, out, err = cli("ckpt", "verify", back, "--json")
    assert code == 0 and json.loads(out)["ok"] and err.startswith(f"verify: {back}, step 0, ")


def test_verify_says_what_it_reads(cli, good):
    ckpt = f"{good}/ckpt/step-000005"
    for flag, how in (([], "reading every chunk"), (["--quick"], "shard sizes only (--quick)")):
        code, out, err = cli("ckpt", "verify", ckpt, *flag)
        assert code == 0 and out.startswith(f"OK {ckpt}: step 5, 2 shards, 63 tensors, ")
        assert err.splitlines() == [f"verify: {ckpt}, step 5, 2 shards, 63 tensors, 1.3 MB on "
                                    f"disk (1.3 MB in shards): {how}"]


def test_a_refused_convert_prints_its_error_alone(cli, good, tmp_path):
    """Checks come before the start line: a refusal is one error line, nothing else."""
    (tmp_path / "full").mkdir()
    (tmp_path / "full" / "x").write_text("")
    code, out, err = cli("ckpt", "convert", str(good), str(tmp_path / "full"), "--plan",
                         _plan(good))
    assert code == 3 and out == "" and err.startswith("error: ") and "convert:" not in err


def test_the_line_is_throttled_and_on_a_terminal_redrawn_then_erased():
    now = [0.0]
    plain = BytesLine("verify", stream=io.StringIO(), tick_s=1.0, plain_every_s=5.0,
                      clock=lambda: now[0])
    tty = BytesLine("verify", stream=Tty(), tick_s=1.0, plain_every_s=5.0, clock=lambda: now[0])
    for t, done in ((0.5, 10), (1.0, 20_000_000), (4.0, 80_000_000), (5.0, 100_000_000),
                    (6.0, 120_000_000), (200.0, 400_000_000)):
        now[0] = t
        plain(done, 400_000_000)
        tty(done, 400_000_000)
    plain.close()
    tty.close()
    assert plain.stream.getvalue() == (
        "verify: 100.0 MB of 400.0 MB (25%), 20.0 MB/s, 5 s, about 15 s left\n"
        "verify: 400.0 MB of 400.0 MB (100%), 2.0 MB/s, 3 min\n")
    shown = tty.stream.getvalue()
    assert shown.count("\r") == 6 and shown.endswith("3 min\x1b[K\r\x1b[K")  # 5 draws, erased


@pytest.mark.parametrize("result, command", [
    ({"dst": "runs/r2/ckpt/step-000000", "latest": "step-000000"},
     "mscale train p.yaml --run-dir runs/r2"),
    ({"dst": "runs/r2/ckpt/step-000004", "latest": "step-000008"},
     "mscale train p.yaml --run-dir runs/r2 --resume runs/r2/ckpt/step-000004"),
    ({"dst": "out"}, "mscale train p.yaml --resume out --run-dir RUN"),
    # a path with a space, printed bare, is two arguments once pasted into a shell
    ({"dst": "sp ace/run 2/ckpt/step-000000", "latest": "step-000000"},
     "mscale train p.yaml --run-dir 'sp ace/run 2'"),
    ({"dst": "my out"}, "mscale train p.yaml --resume 'my out' --run-dir RUN"),
])
def test_a_convert_to_a_layout_names_the_train_command_that_starts_from_it(result, command):
    """A newcomer who imported HF weights was left to guess how to train from them."""
    from mscale.cli.ckpt import _train_from

    assert _train_from("p.yaml", result) == command


def test_a_one_rank_checkpoint_is_counted_in_the_singular(cli, tmp_path):
    """A conversion to a one-process plan said '(1 ranks)', its verify '1 shards'."""
    from mscale.cli.output import counted
    from tests.unit.ckpt.helpers import global_state, plan, write_synthetic

    assert (counted(1, "shard"), counted(0, "rank"), counted(12288, "rank")) == (
        "1 shard", "0 ranks", "12,288 ranks")
    ckpt = tmp_path / "ckpt" / "step-000005"
    write_synthetic(str(ckpt), plan(), global_state(plan()))
    code, out, err = cli("ckpt", "verify", str(ckpt))
    assert code == 0 and out.startswith(f"OK {ckpt}: step 5, 1 shard, ")
    assert err.startswith(f"verify: {ckpt}, step 5, 1 shard, ")
