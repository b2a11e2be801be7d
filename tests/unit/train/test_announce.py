"""The data part of a run's start line (train/announce.py): the sources, their shares of the
blend, the held-out part."""

from __future__ import annotations

from mscale.config.training import DataConfig
from mscale.train.announce import describe_data


def test_the_start_line_says_the_sources_their_shares_and_the_held_out_part():
    blend = DataConfig(sources=[{"path": "src_a"}, {"path": "src_b", "weight": 3}],
                       eval_fraction=0.05)
    assert describe_data(blend) == "data: blend of 2 sources: src_a 25%, src_b 75%; held-out 5% of each"
    assert describe_data(DataConfig(path="t.bin")) == "data: t.bin; no held-out split"
    assert describe_data(DataConfig(path="a", eval_sources=[{"path": "h"}])) == \
        "data: a; held-out: h"
    assert describe_data(DataConfig()).startswith("data: synthetic")


def test_a_small_share_is_never_shown_as_0_nor_a_large_one_as_100():
    """A weight of 1 beside 1,000,000 read "dA 100%, dB 0%": as if dB were not read at all."""
    blend = DataConfig(sources=[{"path": "dA", "weight": 1_000_000}, {"path": "dB", "weight": 1}])
    assert describe_data(blend) == "data: blend of 2 sources: dA >99.9%, dB <0.1%; no held-out split"
    blend = DataConfig(sources=[{"path": "a", "weight": 996}, {"path": "b", "weight": 4}])
    assert describe_data(blend) == "data: blend of 2 sources: a 99.6%, b 0.4%; no held-out split"
    blend = DataConfig(sources=[{"path": "a", "weight": 1}, {"path": "b", "weight": 1}])
    assert describe_data(blend) == "data: blend of 2 sources: a 50%, b 50%; no held-out split"


def test_a_new_global_batch_says_the_held_out_losses_do_not_compare():
    """A resume with --allow-batch-change evaluates the first eval.batches global batches of the
    new size: another held-out set. The data change said so; the batch change said nothing,
    and the held-out curve jumped at the restart unexplained."""
    from mscale.config.training import TrainingConfig
    from mscale.train.announce import batch_change_note

    data = {"path": "d", "eval_fraction": 0.1}
    training = TrainingConfig(global_batch=16, data=data, eval={"interval": 4, "batches": 2})
    note = batch_change_note(("training.global_batch", "training.steps"), training)
    assert note == ("the global batch changed: each evaluation now reads 2 global batch(es) of "
                    "16 held-out samples, another set, so held-out losses before this restart "
                    "and after it are not comparable (docs/data.md)")
    assert batch_change_note(("training.steps",), training) is None
    assert batch_change_note(("training.global_batch",),
                             TrainingConfig(global_batch=16, data=data)) is None  # no eval


def _engine(plan):
    """What `announce` reads of an engine: rank 0 of a 2-process CPU job, no GPU, no eval."""
    from types import SimpleNamespace

    import torch

    return SimpleNamespace(
        plan=plan, env=SimpleNamespace(rank=0, world_size=2, launcher="local"),
        device=torch.device("cpu"), eval_loader=None, timings={}, compiled=False,
        options=SimpleNamespace(json_summary=False, launch=None,
                                faults=SimpleNamespace(armed=False)))


def test_a_restart_records_its_warnings_after_its_own_start_event(tmp_path, monkeypatch):
    """A batch change's warning and "plan changed" were written before the attempt's start
    event, so recover and watch, which begin an attempt at its start, counted them with the
    attempt before; and a change written once a step trains carried ``history: null``."""
    from mscale.config.records import DataSkips
    from mscale.runs.atomic import read_jsonl
    from mscale.runs.lock import LOCK_HELD_ENV
    from mscale.runs.rundir import RunDir
    from mscale.train.announce import announce, event, plan_change_event
    from mscale.train.session import Journal, RunSession, Start
    from tests.unit.runs.test_history import _plan, trained

    monkeypatch.setenv(LOCK_HELD_ENV, "r")
    run = RunDir(str(tmp_path / "run"))
    training = {**_plan().training.model_dump(mode="json", exclude_none=True),
                "data": {"kind": "synthetic"}, "eval": {"interval": 4, "batches": 2}}
    first = _plan(training=training)
    bigger = _plan(training={**training, "global_batch": 32})
    RunSession(run, Journal(run, True), "r").claim(first)
    trained(run)
    s = RunSession(run, Journal(run, True), "r")
    change = s.claim(bigger, allow_batch_change=True)
    assert change.history is None  # written once a step will train
    announce(_engine(bigger), s, Start(change, DataSkips()))
    written = s.write_changed_plan()
    event(s, **plan_change_event(change, written))
    kinds = [(e["kind"], e["message"][:30]) for e in read_jsonl(run.events)]
    assert [k for k, _ in kinds] == ["start", "info", "info"], kinds
    assert kinds[1][1].startswith("the global batch changed")
    changed = read_jsonl(run.events)[-1]
    assert changed["message"] == "plan changed on restart"
    assert changed["evidence"]["history"] == f"{run.plans}/plan-0002.yaml"
    assert "training.global_batch" in changed["evidence"]["fields"]
