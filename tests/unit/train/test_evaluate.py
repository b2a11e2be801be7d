"""The held-out evaluation (`evaluate.evaluate`) on one process: a stop signal ends it between
eval batches, with no loss, and stays pending for the step boundary's decision."""

from __future__ import annotations

import math
import signal
from types import SimpleNamespace

import pytest
import torch

from mscale.train import evaluate as evaluation
from mscale.train.control import Control


def _engine() -> SimpleNamespace:
    """What `evaluate` reads of the engine on a single rank that computes the loss."""
    return SimpleNamespace(param_buffer=SimpleNamespace(wait=lambda: None), micro_batches=2,
                           groups=SimpleNamespace(is_last_stage=True, tp_rank=0))


def _forward_counting(monkeypatch, control: Control, signal_after: int | None) -> list[int]:
    """Each eval batch's forward gives a loss sum of 2.0 (two micro-batches of 1.0) and is
    recorded; a SIGINT arrives during batch ``signal_after`` (0-based), if given."""
    read: list[int] = []

    def forward(engine, loader, batch, m):
        read.append(batch)
        if batch == signal_after:
            control._on_signal(signal.SIGINT, None)
        return torch.tensor(2.0, dtype=torch.float64)

    monkeypatch.setattr(evaluation, "_forward_batch", forward)
    return read


def test_a_stop_signal_ends_the_evaluation_after_the_batch_it_came_in(monkeypatch):
    control = Control(None, rank=0)
    read = _forward_counting(monkeypatch, control, signal_after=2)
    result = evaluation.evaluate(_engine(), None, 400, stop_signalled=control.stop_signalled)
    assert read == [0, 1, 2] and result.stopped_after == 3 and math.isnan(result.loss)
    decision = control.poll()  # the step boundary still sees it: save, then stop
    assert decision.stop and decision.signal


def test_without_a_signal_every_batch_is_read_and_averaged(monkeypatch):
    control = Control(None, rank=0)
    read = _forward_counting(monkeypatch, control, signal_after=None)
    result = evaluation.evaluate(_engine(), None, 5, stop_signalled=control.stop_signalled)
    assert read == list(range(5)) and result.stopped_after is None and result.loss == 1.0


def test_a_signal_in_the_last_batch_leaves_a_complete_evaluation(monkeypatch):
    """Every batch was read: the loss is the held-out loss, and the boundary stops after it."""
    control = Control(None, rank=0)
    _forward_counting(monkeypatch, control, signal_after=4)
    result = evaluation.evaluate(_engine(), None, 5, stop_signalled=control.stop_signalled)
    assert result.stopped_after is None and result.loss == 1.0 and control.poll().stop


def test_the_loop_records_no_held_out_loss_for_an_evaluation_left_early(monkeypatch, capsys):
    from mscale.train import loop

    control = Control(None, rank=0)
    _forward_counting(monkeypatch, control, signal_after=6)
    engine = _engine()
    engine.eval_loader, engine.env = object(), SimpleNamespace(rank=0)
    engine.options = SimpleNamespace(json_summary=False)
    engine.plan = SimpleNamespace(training=SimpleNamespace(
        steps=100, eval=SimpleNamespace(interval=20, batches=400)))
    assert loop._evaluate_if_due(engine, 20, control).stopped_after == 7
    out = capsys.readouterr().out
    assert "eval at step 20 left after 7 of 400 held-out batches on a stop signal: no held-out " \
           "loss recorded" in out and "loss nan" not in out


def test_a_stop_signal_in_the_baseline_evaluation_stops_before_step_1(monkeypatch, capsys):
    """Step 1 would train and be saved: the run, resumed at step 1, never took its baseline."""
    from mscale.train import loop

    control = Control(None, rank=0)
    _forward_counting(monkeypatch, control, signal_after=0)
    engine = _engine()
    engine.eval_loader, engine.env = object(), SimpleNamespace(rank=0)
    engine.options = SimpleNamespace(json_summary=False, progress=False, log_interval=1,
                                     timeout_s=60)
    engine.plan = SimpleNamespace(training=SimpleNamespace(
        steps=100, tensorboard=False, eval=SimpleNamespace(interval=20, batches=400)))
    events = []
    monkeypatch.setattr(loop, "event", lambda s, **kw: events.append(kw))
    monkeypatch.setattr(loop, "_steps", lambda *a: pytest.fail("step 1 trained"))
    code, stop = loop._loop(engine, None, None, control, 0, None)
    assert (code, stop[:2]) == (1, ("signal", 0)) and "nothing trained" in stop[2]
    assert [e["kind"] for e in events] == ["signal"]
    assert "stopping before the first step" in capsys.readouterr().out
