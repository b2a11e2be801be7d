"""A resume that failed reading a damaged checkpoint: the diagnosis names the checkpoint
(storage / damaged_checkpoint, no suspect), the choice passes it over however it is verified, and
the verdict is a rollback (degraded), not bad input. Bad input about anything else (a plan field,
a data file, a checkpoint of another model) stays unrecoverable.

The error messages are the checkpoint package's own, made here by loading a damaged synthetic
checkpoint (as train's resume does) and written into fabricated error files (diag_runs.py) the
way train/failure.py writes them: a change of wording there fails these tests, not a user."""

from __future__ import annotations

import json
import os
from pathlib import Path

import pytest

from mscale.ckpt import catalog
from mscale.ckpt.load import CheckpointReader
from mscale.errors import MscaleError
from mscale.recover.checkpoints import FAILED_READING, choose_checkpoint, names_damaged
from mscale.recover.decide import RecoverOptions, plan_recovery
from mscale.recover.decision import Diagnosis
from mscale.recover.diagnose import diagnose
from mscale.runs.rundir import RunDir
from mscale.train.failure import one_line
from tests.unit.ckpt.helpers import global_state, plan, write_synthetic
from tests.unit.recover.diag_runs import Run

SHARD = "rank-00000.bin"


@pytest.fixture(scope="module")
def tensors():
    return global_state(plan(), optimizer=False)


def flip(path: str) -> None:
    size = os.path.getsize(path)
    with open(path, "r+b") as f:
        f.seek(size // 2)
        byte = f.read(1)
        f.seek(size // 2)
        f.write(bytes([byte[0] ^ 0xFF]))


def load_error(ckpt: str) -> str:
    """What a resume of ``ckpt`` says, as train's error file holds it (`one_line`)."""
    manifest = catalog.load_committed(ckpt)
    with pytest.raises(MscaleError) as e, CheckpointReader(ckpt, manifest) as reader:
        for key in manifest.tensors:
            reader.read_full(key)
    return one_line(e.value)


class Resumed:
    """A run with checkpoints at steps 2, 4, 6 whose attempt 2 failed resuming from one of them;
    the job ran in ``cwd`` with ``--run-dir run`` (so its errors name ``run/ckpt/...``)."""

    def __init__(self, root: Path, tensors):
        self.cwd = root
        self.run = Run(root / "run")
        self.rundir = RunDir(self.run.path)
        self.rundir.create()
        for s in (2, 4, 6):
            write_synthetic(f"{self.rundir.ckpt}/{catalog.step_dir(s)}", plan(), tensors, step=s)
        argv = ["mscale", "train", "plan.yaml", "--local", "4", "--run-dir", "run"]
        self.launch = {"argv": argv, "cwd": str(root), "plan": str(root / "run/plan.yaml"),
                       "local": 4, "nodes": ["node1", "node2"], "slurm": None}
        rid = self.run.start(0.0, launch=self.launch)
        self.run.metrics(range(1, 7), t=1.0)
        self.run.finish(10.0, 0, 6, rid)
        self.rid = self.run.start(100.0, attempt=2, launch=self.launch)

    def ckpt(self, step: int) -> str:
        return f"{self.rundir.ckpt}/{catalog.step_dir(step)}"

    def fail(self, message: str, **record) -> None:
        """Every rank's error file says ``message`` (train's `ckpt/agree.py` `agree` raises it on every rank);
        the launcher records rank 0 first."""
        for rank in range(4):
            self.run.error_file(rank, 101.0, "bad_input", message, node=f"node{rank // 2 + 1}")
            if record:
                p = self.run.root / "logs" / f"rank{rank}.error.json"
                p.write_text(json.dumps({**json.loads(p.read_text()), **record}))
        self.run.launcher_stop(102.0, self.rid, 0, "exited with code 3", "bad_input",
                               [3, 3, 3, 3])


@pytest.fixture
def resumed(tmp_path, tensors) -> Resumed:
    return Resumed(tmp_path, tensors)


def as_the_job_named_it(r: Resumed, message: str) -> str:
    """The message with the checkpoint path the job wrote: relative to its working directory."""
    return message.replace(str(r.cwd) + "/", "")


def test_a_flipped_byte_is_a_damaged_checkpoint_no_node_is_suspected(resumed):
    flip(f"{resumed.ckpt(6)}/{SHARD}")
    message = as_the_job_named_it(resumed, load_error(resumed.ckpt(6)))
    assert message.startswith(f"run/ckpt/step-000006/{SHARD}: ") and "checksum mismatch" in message
    resumed.fail(message)
    d = diagnose(resumed.run.path)
    assert (d.cls, d.symptom, d.transient) == ("storage", "damaged_checkpoint", False)
    assert d.suspect_ranks == [] and d.suspect_nodes == []
    assert d.damaged_checkpoint == resumed.ckpt(6)  # made absolute against the launch's cwd
    assert d.damaged_error.startswith(f"{SHARD}: ") and d.damaged_error.endswith(
        "checksum mismatch")
    assert "; fix:" not in d.damaged_error


@pytest.mark.parametrize("verify", ["quick", "full"])
def test_quick_and_full_pass_it_over_with_the_loads_words_and_roll_back(resumed, verify):
    flip(f"{resumed.ckpt(6)}/{SHARD}")
    resumed.fail(as_the_job_named_it(resumed, load_error(resumed.ckpt(6))))
    plan_ = plan_recovery(resumed.run.path, RecoverOptions(verify=verify, recheck=False))
    c = plan_.checkpoint
    assert c.step == 4 and not c.is_latest
    [r] = c.rejected
    assert r["name"] == "step-000006" and r["why"].startswith(f"{FAILED_READING}: {SHARD}: ")
    assert "checksum mismatch" in r["why"]
    assert plan_.verdict == "degraded" and plan_.exit_code == 1
    assert plan_.exclusions.nodes == []
    assert plan_.command[-2:] == ["--resume", resumed.ckpt(4)]
    assert plan_.reasons[0].startswith("rolled back to step 4, passing over step-000006 "
                                       f"({FAILED_READING}: {SHARD}: ")
    assert not any("fix the code or input" in x for x in plan_.reasons)


def test_a_truncated_shard_the_load_named_is_passed_over_too(resumed):
    path = f"{resumed.ckpt(6)}/{SHARD}"
    with open(path, "r+b") as f:
        f.truncate(os.path.getsize(path) - 8)
    message = load_error(resumed.ckpt(6))  # absolute: a job started with an absolute --run-dir
    assert "the manifest says" in message
    resumed.fail(message)
    d = diagnose(resumed.run.path)
    assert d.symptom == "damaged_checkpoint" and d.damaged_checkpoint == resumed.ckpt(6)
    assert choose_checkpoint(resumed.rundir, d).step == 4


def test_the_error_files_own_file_field_is_preferred_to_the_message(resumed):
    resumed.fail("optim.x: chunk 0: checksum mismatch; fix: run `mscale ckpt verify`",
                 file=f"run/ckpt/step-000004/{SHARD}")
    d = diagnose(resumed.run.path)
    assert d.damaged_checkpoint == resumed.ckpt(4)
    c = choose_checkpoint(resumed.rundir, d)
    assert c.step == 6 and c.is_latest and c.rejected == []  # newer than the damaged one


@pytest.mark.parametrize("message", [
    "run/plan.yaml: layout.tp: must divide model.heads (4); fix: use tp 1, 2 or 4",
    "data/train.bin: not found; fix: prepare it with `mscale data prepare`",
    "run/ckpt/step-000006: tensors: the checkpoint has no tensor model/x; fix: was it saved "
    "from a different model?",
    "run/ckpt/step-000006/manifest.json: is 9 bytes; fix: use a newer mscale",
])
def test_bad_input_about_anything_else_stays_unrecoverable(resumed, message):
    resumed.fail(message)
    d = diagnose(resumed.run.path)
    assert (d.cls, d.symptom, d.damaged_checkpoint) == ("user_code", "bad_input", None)
    plan_ = plan_recovery(resumed.run.path, RecoverOptions(recheck=False))
    assert plan_.verdict == "unrecoverable" and plan_.checkpoint.step == 6
    assert any("fix the code or input" in x for x in plan_.reasons)


def test_a_damaged_checkpoint_of_another_run_is_not_passed_over_and_is_refused(resumed, tmp_path):
    other = f"{tmp_path}/other/ckpt/step-000006"
    resumed.fail(f"{other}/{SHARD}: optim.x: chunk 0: checksum mismatch; fix: run `mscale ckpt "
                 "verify`")
    d = diagnose(resumed.run.path)
    assert d.damaged_checkpoint == other and names_damaged(resumed.rundir, d) is None
    plan_ = plan_recovery(resumed.run.path, RecoverOptions(recheck=False))
    assert plan_.checkpoint.step == 6 and plan_.checkpoint.rejected == []
    assert plan_.verdict == "unrecoverable" and plan_.command == []
    assert any("not one of this run's checkpoints" in x for x in plan_.reasons)


def test_the_only_checkpoint_damaged_leaves_nothing_to_resume(resumed):
    for s in (2, 4):
        catalog.remove(resumed.ckpt(s))
    resumed.fail(f"run/ckpt/step-000006/{SHARD}: optim.x: chunk 0: checksum mismatch")
    plan_ = plan_recovery(resumed.run.path, RecoverOptions(recheck=False))
    assert plan_.checkpoint.path is None and plan_.verdict == "unrecoverable"
    assert any("no usable checkpoint" in x for x in plan_.reasons)


def test_a_moved_run_directory_still_matches_by_its_last_two_parts(resumed, tmp_path):
    """The failure named the path on the cluster; recover reads a copy elsewhere."""
    d = Diagnosis(cls="storage", symptom="damaged_checkpoint", summary="",
                  damaged_checkpoint="/lustre/u/run/ckpt/step-000006", damaged_error="x")
    assert names_damaged(resumed.rundir, d) == "step-000006"
    assert choose_checkpoint(resumed.rundir, d).step == 4
    d.damaged_checkpoint = "/lustre/u/elsewhere/ckpt/step-000006"
    assert names_damaged(resumed.rundir, d) is None
    d.damaged_checkpoint = "s3://bucket/run/ckpt/step-000006"  # another filesystem
    assert names_damaged(resumed.rundir, d) is None
