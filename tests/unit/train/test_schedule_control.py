import math
import os
import signal

from mscale.config.training import TrainingConfig
from mscale.train.control import Control
from mscale.train.schedule import learning_rate
from mscale.train.timers import StepTimer


def test_warmup_then_cosine_to_min():
    cfg = TrainingConfig(global_batch=8, steps=110, warmup_steps=10, lr=1.0, min_lr=0.1)
    assert learning_rate(cfg, 0) == 0.1 and learning_rate(cfg, 9) == 1.0
    assert math.isclose(learning_rate(cfg, 10), 1.0)
    assert math.isclose(learning_rate(cfg, 60), 0.55)
    assert math.isclose(learning_rate(cfg, 110), 0.1)


def test_control_files_are_consumed_once(tmp_path):
    ctl = tmp_path / "control"
    ctl.mkdir()
    (ctl / "checkpoint").write_text("")
    (ctl / "unrelated").write_text("")
    c = Control(str(ctl), rank=0)
    d = c.poll()
    assert d.checkpoint and not d.stop
    assert not c.poll().checkpoint  # consumed
    assert (ctl / "unrelated").exists()
    assert not Control(str(ctl), rank=1).poll().checkpoint  # only rank 0 reads


def test_signal_becomes_halt_decision(tmp_path):
    c = Control(None, rank=0)
    c.install_signal_handlers()
    try:
        os.kill(os.getpid(), signal.SIGUSR1)
        assert c.poll().stop
    finally:
        signal.signal(signal.SIGUSR1, signal.SIG_DFL)
        signal.signal(signal.SIGTERM, signal.SIG_DFL)


def test_timer_splits_regions():
    import time

    t = StepTimer()
    t.start_step()
    with t.region("comm_wait"):
        time.sleep(0.02)
    with t.region("data"):
        time.sleep(0.01)
    time.sleep(0.01)
    out = t.end_step()
    assert out["comm_wait"] >= 0.02 and out["data"] >= 0.01 and out["compute"] >= 0.009
    assert math.isclose(out["step"], out["compute"] + out["comm_wait"] + out["data"] + out["bubble"])


def test_collective_time_inside_a_region_counts_once_as_comm():
    import time

    from mscale.dist.collectives import COMM_CLOCK

    t = StepTimer()
    t.start_step()
    with t.region("data"):
        time.sleep(0.01)
        with COMM_CLOCK.timed():  # e.g. the batch broadcast to TP peers
            time.sleep(0.03)
    out = t.end_step()
    assert 0.01 <= out["data"] < 0.025 and out["comm_wait"] >= 0.03
    assert math.isclose(out["step"], out["compute"] + out["comm_wait"] + out["data"] + out["bubble"])
