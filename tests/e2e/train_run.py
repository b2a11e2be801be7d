"""Helpers of the end-to-end train tests: the installed binary, a 4-process plan, JSONL records."""

from __future__ import annotations

import json
import os
import subprocess
from pathlib import Path

import yaml

from tests.conftest import PLANS, REPO

MSCALE = str(Path(os.environ.get("VIRTUAL_ENV", REPO / ".venv")) / "bin" / "mscale")
if not os.path.exists(MSCALE):
    import shutil

    MSCALE = shutil.which("mscale") or MSCALE


def small_plan(tmp_path: Path, **layout) -> str:
    """The embedded tiny plan on 4 processes (tp2 dp2, two 2-process nodes): quicker to start.
    One micro-batch of 8 per rank and step (cpu-tiny has 4 of 2): a step's cost on gloo is its
    count of TP collectives, not its tokens, so steps take ~0.25 s instead of ~0.7 s on two
    cores. Layout keys (``micro_batch`` included) override, in the training section too."""
    data = yaml.safe_load((PLANS / "cpu-tiny.yaml").read_text())
    data["cluster"]["hostlist"] = "node[1-2]"
    layout = {"pp": 1, "micro_batch": 8, **layout}
    for choice in ("micro_batch", "zero_stage", "recompute"):  # train refuses the two differing
        data["training"][choice] = layout.get(choice, data["layout"][choice])
    data["layout"].update(layout)
    path = tmp_path / "plan.yaml"
    path.write_text(yaml.safe_dump(data))
    return str(path)


def mscale(*args: str, timeout: float = 180) -> subprocess.CompletedProcess:
    return subprocess.run([MSCALE, *args], cwd=REPO, text=True, capture_output=True,
                          timeout=timeout)


def records(path: Path) -> list[dict]:
    return [json.loads(line) for line in path.read_text().splitlines() if line.strip()]




HANG_GUARD_S = 240
"""How long a test waits for a job whose rank hangs: far below gloo's 30-minute default timeout,
so a job that ignored ``--timeout`` fails the test, and far above what the job takes on a loaded
two-core machine. That the job's own timeout fired is checked by `assert_timed_out_after`, not by
the wall clock."""


def assert_timed_out_after(run: Path, seconds: float, at_connect: bool = False) -> None:
    """Some rank's error file says its collective or rendezvous gave up after the job's
    ``--timeout`` (gloo and the store name it in milliseconds): the timeout that fired is the
    job's, not gloo's 30-minute default. ``at_connect``: a rank stopped at start-up may stop
    its peers in gloo's full-mesh connect, whose ``Connect timeout`` names no figure (seen once
    in ~30 runs); that the job ended within `HANG_GUARD_S` is then what shows it was not the
    default."""
    want = f"{int(seconds * 1000)}ms"
    messages = [json.loads(f.read_text()).get("message", "")
                for f in sorted((run / "logs").glob("rank*.error.json"))]
    assert any(want in m or (at_connect and "connectFullMesh failed" in m
                             and "Connect timeout" in m) for m in messages), messages


def text_data(root: Path, vocab: int = 300) -> dict:
    """A real-text token dataset for the end-to-end runs: a few of the Python standard library's
    own source files, a BPE tokenizer trained on them and the tokens prepared as shards
    (mscale.data, in this process: seconds). Returns the ``training.data`` section that blends
    it with a second source (the corpus's first three files again, weighted 1:3), shuffled, with
    a tenth held out."""
    import sysconfig

    from mscale.data.prepare import prepare
    from mscale.data.tokenizer import train_tokenizer

    std = Path(sysconfig.get_paths()["stdlib"])
    files = [str(std / f"{name}.py") for name in ("argparse", "textwrap", "string", "shlex",
                                                   "fnmatch", "glob", "heapq", "bisect")]
    tok = str(root / "tokenizer.json")
    train_tokenizer(files, vocab, tok, text_exts=[".py"])
    prepare(files, tok, str(root / "stdlib"), workers=1, text_exts=[".py"])
    prepare(files[:3], tok, str(root / "first3"), workers=1, text_exts=[".py"])
    return {"sources": [{"path": str(root / "stdlib"), "weight": 3.0},
                        {"path": str(root / "first3"), "weight": 1.0}],
            "eval_fraction": 0.1}


def text_plan(tmp_path: Path, data: dict, eval_interval: int = 3, **layout) -> str:
    """`small_plan` on the real-text dataset of `text_data`, with a held-out loss."""
    path = Path(small_plan(tmp_path, **layout))
    plan = yaml.safe_load(path.read_text())
    plan["model"]["vocab"] = 512
    plan["training"]["data"] = data
    plan["training"]["eval"] = {"interval": eval_interval, "batches": 1}
    path.write_text(yaml.safe_dump(plan))
    return str(path)
