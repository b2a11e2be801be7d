"""ckpt/listing.py: what `mscale ckpt ls` reports (status, pins and their fallback, warnings) and
the one size and layout format of the ckpt commands. The CLI's own tests are in test_verify.py."""

from __future__ import annotations

import shutil

import pytest

from mscale.ckpt import pins
from mscale.ckpt.listing import UNREADABLE_PIN, format_bytes, layout_text, list_checkpoints
from mscale.errors import MscaleError
from tests.unit.ckpt.helpers import global_state, plan, write_synthetic


@pytest.mark.parametrize("n, text", [(0, "0 B"), (999, "999 B"), (1000, "1.0 KB"),
                                     (3_141_593, "3.1 MB"), (2.5e9, "2.5 GB"),
                                     (1.2e12, "1.2 TB"), (7e15, "7000.0 TB")])
def test_format_bytes(n, text):
    assert format_bytes(n) == text


def test_layout_text():
    assert layout_text({"tp": 2, "pp": 1, "dp": 4, "zero_stage": 1}) == "tp2 pp1 dp4 zero1"
    assert layout_text({"tp": 2, "pp": 2, "vpp": 2, "dp": 2, "zero_stage": 2, "world": 8}) == \
        "tp2 pp2 v2 dp2 zero2"
    assert layout_text(None) == "-" and layout_text({}) == "-"


@pytest.fixture(scope="module")
def good(tmp_path_factory):
    root = tmp_path_factory.mktemp("run") / "ckpt"
    p = plan(tp=2, dp=2, zero=1)
    write_synthetic(str(root / "step-000005"), p, global_state(p))
    return root.parent


@pytest.fixture
def run(good, tmp_path):
    return shutil.copytree(good, tmp_path / "run")


def test_a_clean_run_lists_committed_latest_and_no_warning(run):
    for where in (run, run / "ckpt"):  # the run or its ckpt/ directory
        listing = list_checkpoints(str(where))
        (row,) = listing.checkpoints
        assert listing.latest == "step-000005" and listing.warnings == []
        assert (row["status"], row["latest"], row["pin"], row["note"]) == ("committed", True,
                                                                          None, None)
        assert row["layout"]["tp"] == 2 and row["bytes"] > 0
    assert list(listing.to_json()) == ["run", "latest", "checkpoints", "warnings", "checkpoint",
                                       "run_dir"]
    assert (listing.checkpoint, listing.run_dir) == (None, None)


def test_partial_directories_pins_and_their_fallback(run):
    (run / "ckpt" / "step-000009").mkdir()
    pins.pin(str(run / "ckpt" / "step-000005"), "before the spike", "me", now=1.0)
    listing = list_checkpoints(str(run))
    assert [(r["step"], r["status"]) for r in listing.checkpoints] == [(5, "committed"),
                                                                       (9, "partial")]
    assert listing.checkpoints[0]["pin"] == {"reason": "before the spike", "who": "me",
                                             "time": 1.0}
    (run / "ckpt" / "step-000005" / "KEEP").unlink()
    (run / "ckpt" / "step-000005" / "KEEP").mkdir()  # damaged: still a pin, and a warning
    listing = list_checkpoints(str(run))
    assert listing.checkpoints[0]["pin"] == UNREADABLE_PIN
    assert len(listing.warnings) == 1 and "KEEP" in listing.warnings[0]


def test_a_keep_file_nested_deep_still_pins(run):
    """A KEEP of 64 KiB of brackets used to reach json.loads unbounded (RecursionError)."""
    (run / "ckpt" / "step-000005" / "KEEP").write_bytes(b"[" * 60_000)
    (row,) = list_checkpoints(str(run)).checkpoints
    assert row["pin"]["who"] == "unknown" and row["note"] is None


def test_latest_naming_no_committed_checkpoint_and_a_bad_latest_are_warnings(run):
    (run / "ckpt" / "latest").write_text("step-000007\n")
    listing = list_checkpoints(str(run))
    assert listing.latest == "step-000007" and not listing.checkpoints[0]["latest"]
    assert "names step-000007, which is not a committed checkpoint" in listing.warnings[0]
    (run / "ckpt" / "latest").write_bytes(b"\x00\xff")
    listing = list_checkpoints(str(run))
    assert listing.latest is None and "NUL byte" in listing.warnings[0]


def test_a_committed_checkpoint_newer_than_latest_or_no_latest_is_a_warning(run):
    """A crash between a commit and its pointer: ls marked the pointer's older checkpoint latest
    with exit 0, while a resume (and now verify and convert of the run) load the newer one."""
    p = plan(tp=2, dp=2, zero=1)
    write_synthetic(str(run / "ckpt" / "step-000007"), p, global_state(p), step=7)
    (run / "ckpt" / "latest").write_text("step-000005")
    listing = list_checkpoints(str(run))
    assert [r["latest"] for r in listing.checkpoints] == [True, False]
    [w] = listing.warnings
    assert "names step-000005, but step-000007 is committed and newer" in w
    assert "--resume auto" in w and w.endswith("use step-000007")
    (run / "ckpt" / "latest").unlink()
    [w] = list_checkpoints(str(run)).warnings
    assert "latest is missing; step-000007 is the newest committed checkpoint" in w


def test_a_manifest_edited_after_its_commit_is_a_warning_not_committed(run):
    """ls trusted the marker's presence: an altered manifest, which verify and a resume refuse,
    was listed as committed and latest, exit 0."""
    m = run / "ckpt" / "step-000005" / "manifest.json"
    m.write_bytes(m.read_bytes() + b" ")  # still parses; no longer what was committed
    listing = list_checkpoints(str(run))
    assert listing.warnings and "sha256" in " ".join(listing.warnings)
    assert listing.checkpoints[0]["note"] is not None
    # `latest` names it: committed, then damaged, not "not a committed checkpoint" (a crash)
    assert "names step-000005, whose manifest cannot be used" in listing.warnings[0]
    assert "not a committed checkpoint" not in " ".join(listing.warnings)


def test_no_ckpt_directory_is_bad_input(tmp_path):
    with pytest.raises(MscaleError, match="no ckpt/ directory") as e:
        list_checkpoints(str(tmp_path))
    assert e.value.code == 3 and "RUN_DIR/ckpt/step-NNNNNN" in e.value.fix
    with pytest.raises(MscaleError, match="no such directory"):
        list_checkpoints(str(tmp_path / "nowhere"))


@pytest.mark.parametrize("given", ["ckpt/step-000005", "ckpt/step-000005/", "ckpt/latest",
                                   "ckpt/step-000005/manifest.json"])
def test_one_checkpoint_given_is_listed_alone_with_its_run_named(run, cli, given):
    """``ls RUN/ckpt/step-000004`` (a checkpoint where a run was expected) said "no ckpt/
    directory here" and sent the user to `mscale train --run-dir`'s directory, unnamed."""
    p = plan(tp=2, dp=2, zero=1)
    write_synthetic(str(run / "ckpt" / "step-000003"), p, global_state(p), step=3)
    listing = list_checkpoints(str(run / given))
    [r] = listing.checkpoints
    assert (r["name"], r["step"], r["status"], r["latest"]) == ("step-000005", 5, "committed",
                                                                True)
    assert listing.run_dir == str(run) and listing.warnings == []
    assert listing.checkpoint.rstrip("/").endswith("ckpt/step-000005")
    code, out, _ = cli("ckpt", "ls", str(run / given))
    assert code == 0 and "step-000003" not in out
    assert f"step-000005 alone: `mscale ckpt ls {run}` lists every checkpoint of the run" in out


def test_a_checkpoint_outside_a_run_lists_its_manifests_step(run, tmp_path):
    out = tmp_path / "converted"
    shutil.copytree(run / "ckpt" / "step-000005", out)
    [r] = list_checkpoints(str(out)).checkpoints
    assert (r["name"], r["step"], r["status"]) == ("converted", 5, "committed")
    assert list_checkpoints(str(out)).run_dir is None


def test_ls_verify_and_convert_print_the_same_size_on_disk(run, tmp_path):
    """ls summed every file (index files, manifest, marker), verify the shards alone: for one
    checkpoint they printed two sizes under the same word."""
    from mscale.ckpt.convert import convert
    from mscale.ckpt.verify import verify
    from mscale.config.base import dump_yaml

    ckpt = run / "ckpt" / "step-000005"
    pins.pin(str(ckpt), "kept", "me")
    rep = verify(str(ckpt))
    [r] = list_checkpoints(str(run)).checkpoints
    on_disk = sum(f.stat().st_size for f in ckpt.iterdir())
    assert r["bytes"] == rep.bytes == on_disk and rep.shard_bytes < rep.bytes
    (tmp_path / "p.yaml").write_text(dump_yaml(plan(tp=1, dp=2)))
    done = convert(str(ckpt), str(tmp_path / "out"), plan=str(tmp_path / "p.yaml"))
    assert done["bytes"] == verify(str(tmp_path / "out")).bytes


def test_unpin_refuses_what_is_not_a_checkpoint(tmp_path):
    with pytest.raises(MscaleError, match="no manifest.json") as e:
        pins.unpin(str(tmp_path / "nowhere"))
    assert e.value.code == 3
