import math
import os
import signal
import time

import pytest
import torch

from mscale.config.training import TrainingConfig
from mscale.train import control
from mscale.train.control import STOP_SIGNALS, Control
from mscale.train.schedule import learning_rate
from mscale.distributed.collectives import COMM_CLOCK, CudaClock, HostClock
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


def test_requests_waiting_before_the_start_are_named_and_left_for_the_first_poll(tmp_path):
    ctl = tmp_path / "control"
    (ctl / "halt").mkdir(parents=True)
    (ctl / "unrelated").write_text("")
    c = Control(str(ctl), rank=0)
    waiting = c.waiting()
    assert [name for name, _ in waiting] == ["halt"] and waiting[0][1] > 0
    assert Control(str(ctl), rank=1).waiting() == []  # only rank 0 reads
    assert c.poll().halt and c.waiting() == []


def test_signal_becomes_halt_decision(tmp_path, terminal_signals):
    c = Control(None, rank=0)
    c.install_signal_handlers()
    os.kill(os.getpid(), signal.SIGUSR1)
    assert c.poll().stop


@pytest.fixture
def terminal_signals():
    """The stop signals as a process started from a terminal has them (a test runner may have
    SIGHUP ignored, under nohup, or SIGINT changed by an earlier test), restored after."""
    saved = {sig: signal.getsignal(sig) for sig in STOP_SIGNALS}
    for sig in STOP_SIGNALS:
        signal.signal(sig, signal.default_int_handler if sig == signal.SIGINT else signal.SIG_DFL)
    yield
    for sig, handler in saved.items():
        signal.signal(sig, handler)


def test_a_warning_signal_received_while_starting_is_the_loops_stop(tmp_path, terminal_signals):
    """SLURM's --signal=USR1@N can come while the task imports torch or loads a checkpoint; its
    default killed the task with nothing recorded. `mscale train` notes it from its first line
    and the loop's Control counts it as received: the first boundary saves and stops."""
    from mscale.cli.main import starts_training_here
    from mscale.distributed import early_signals

    assert starts_training_here(["train", "plan.yaml", "--run-dir", "r"])
    assert not starts_training_here(["train", "--local", "8"])
    assert not starts_training_here(["train", "--local=8"])
    assert not starts_training_here(["watch", "r"])
    early_signals.remember()
    os.kill(os.getpid(), signal.SIGUSR1)  # before the loop listens: noted, not fatal
    c = Control(None, rank=0)
    c.install_signal_handlers()
    decision = c.poll()
    assert decision.stop and decision.signal and c.signal_name == "SIGUSR1"
    assert early_signals.take() == []  # taken over once


def test_ctrl_c_asks_for_a_halt_and_a_second_one_interrupts_at_once(monkeypatch,
                                                                   terminal_signals):
    now = [100.0]
    monkeypatch.setattr(control.time, "monotonic", lambda: now[0])
    c = Control(None, rank=0)
    c.install_signal_handlers()
    os.kill(os.getpid(), signal.SIGINT)
    os.kill(os.getpid(), signal.SIGTERM)  # under --local the launcher's SIGTERM follows
    os.kill(os.getpid(), signal.SIGINT)  # the same press, passed on again by a wrapper
    assert c.poll().stop and c.signal_name == "SIGINT"
    now[0] += 2.0
    with pytest.raises(KeyboardInterrupt):
        os.kill(os.getpid(), signal.SIGINT)


def test_sighup_is_a_halt_and_an_ignored_signal_stays_ignored(terminal_signals):
    signal.signal(signal.SIGHUP, signal.SIG_IGN)  # nohup, or a --local worker's launcher
    c = Control(None, rank=0)
    c.install_signal_handlers()
    assert signal.getsignal(signal.SIGHUP) is signal.SIG_IGN
    signal.signal(signal.SIGHUP, signal.SIG_DFL)
    c.install_signal_handlers()
    os.kill(os.getpid(), signal.SIGHUP)
    assert c.poll().stop and c.signal_name == "SIGHUP"


@pytest.mark.parametrize("said", ["SIGINT", "SIGHUP"])
def test_the_launchers_sigterm_is_named_as_the_signal_the_launcher_got(monkeypatch, said,
                                                                       terminal_signals):
    """A SIGINT or SIGHUP sent to the --local launcher alone reaches the workers as SIGTERM;
    the launcher says which it got first, and that is the stop's signal, not a preemption's."""
    monkeypatch.setattr(control, "launcher_stop_signal", lambda: said)
    c = Control(None, rank=0)
    c.install_signal_handlers()
    os.kill(os.getpid(), signal.SIGTERM)
    assert c.poll().stop and c.signal_name == said


def test_a_signal_the_rank_got_itself_is_not_renamed_by_the_launcher(monkeypatch,
                                                                     terminal_signals):
    monkeypatch.setattr(control, "launcher_stop_signal", lambda: "SIGHUP")
    c = Control(None, rank=0)
    c.install_signal_handlers()
    os.kill(os.getpid(), signal.SIGUSR1)  # SLURM's warning to this rank: the scheduler's
    assert c.poll().stop and c.signal_name == "SIGUSR1"


class FakeNow:
    """A clock that moves only when the test says: region arithmetic without real sleeps."""

    def __init__(self) -> None:
        self.t = 100.0

    def __call__(self) -> float:
        return self.t

    def sleep(self, seconds: float) -> None:
        self.t += seconds


def _timer() -> tuple[StepTimer, FakeNow]:
    now = FakeNow()
    return StepTimer(clock=HostClock(now)), now


def test_timer_splits_regions():
    t, now = _timer()
    t.start_step()
    with t.region("comm_wait", link="dp"):
        now.sleep(0.02)
    with t.region("data"):
        now.sleep(0.01)
    now.sleep(0.01)
    t.add("bubble", 0.005)
    out = t.end_step()
    assert out["comm_wait"] == pytest.approx(0.02) and out["data"] == pytest.approx(0.01)
    assert out["comm_dp"] == pytest.approx(0.02) and out["comm_tp"] == out["comm_pp"] == 0.0
    assert out["step"] == pytest.approx(0.04) and out["compute"] == pytest.approx(0.005)
    assert math.isclose(out["step"], out["compute"] + out["comm_wait"] + out["data"] + out["bubble"])
    t.start_step()  # a new step starts from zero
    now.sleep(0.03)
    assert t.end_step() == pytest.approx({"step": 0.03, "compute": 0.03, "comm_wait": 0.0,
                                          "data": 0.0, "bubble": 0.0, "comm_tp": 0.0,
                                          "comm_pp": 0.0, "comm_dp": 0.0})


def test_collective_time_inside_a_region_counts_once_as_comm():
    t, now = _timer()
    COMM_CLOCK.use(HostClock(FakeNow()))  # a stale clock: start_step must install the timer's
    t.start_step()
    with COMM_CLOCK.timed("tp"):  # e.g. a TP all-reduce inside forward
        now.sleep(0.002)
    with t.region("data"):
        now.sleep(0.01)
        with COMM_CLOCK.timed("tp"):  # e.g. the batch broadcast to TP peers
            now.sleep(0.03)
    out = t.end_step()
    assert out["data"] == pytest.approx(0.01) and out["comm_wait"] == pytest.approx(0.032)
    assert out["comm_tp"] == pytest.approx(0.032)
    assert out["step"] == pytest.approx(0.042) and out["compute"] == pytest.approx(0.0, abs=1e-12)


def test_collectives_between_steps_are_not_counted():
    t, now = _timer()
    t.start_step()
    now.sleep(0.01)
    t.end_step()
    with COMM_CLOCK.timed("dp"):  # metrics gather, control all-reduce
        time.sleep(0.001)
    t.start_step()
    now.sleep(0.01)
    assert t.end_step()["comm_wait"] == 0.0


def test_default_clock_follows_the_device():
    assert isinstance(StepTimer().clock, HostClock)
    assert isinstance(StepTimer(torch.device("cuda", 0)).clock, CudaClock)  # no GPU needed


class FakeEvents:
    """The GPU clock's contract on a CPU: marks are events readable only after `settle`, as
    CUDA events are only after the synchronize; reading one earlier would be a host sync."""

    immediate = False

    def __init__(self, now: FakeNow):
        self.now, self.settles, self.recycled = now, 0, 0
        self._live, self._settled = [], set()

    def mark(self):
        event = [self.now()]  # a fresh object per mark, like an event
        self._live.append(event)
        return event

    def seconds(self, a, b) -> float:
        assert {id(a), id(b)} <= self._settled, "read before the step's synchronize"
        return b[0] - a[0]

    def settle(self, last) -> None:
        self.settles += 1
        self._settled |= {id(e) for e in self._live}

    def recycle(self) -> None:
        self.recycled += 1


def test_device_clock_is_read_once_per_step_after_one_settle():
    now = FakeNow()
    clock = FakeEvents(now)
    t = StepTimer(clock=clock)
    for step in range(2):
        t.start_step()
        with COMM_CLOCK.timed("tp"):
            now.sleep(0.004)
        with t.region("bubble", link="pp"):
            now.sleep(0.002)
            with COMM_CLOCK.timed("dp"):
                now.sleep(0.001)
        t.add("comm_wait", 0.5)  # host seconds measured elsewhere still add up
        now.sleep(0.003)
        assert clock.settles == step and clock.recycled == step  # no sync inside the step
        out = t.end_step()
        assert clock.settles == step + 1 and clock.recycled == step + 1
        assert out == pytest.approx({"step": 0.01, "bubble": 0.002, "comm_wait": 0.505,
                                     "data": 0.0, "compute": 0.0, "comm_tp": 0.004,
                                     "comm_pp": 0.002, "comm_dp": 0.001})
    assert isinstance(COMM_CLOCK.clock, HostClock)  # between steps: not the device clock


class _Loader:
    def get(self, step, j):
        g = torch.Generator().manual_seed(10 * step + j)
        x = torch.randn(3, 4, generator=g)
        return x, x.sum(1)


class _Engine:
    """What `run_micro_batches` reads of an engine, without process groups."""

    def __init__(self, m: int):
        import contextlib
        from types import SimpleNamespace

        torch.manual_seed(0)
        lin = torch.nn.Linear(4, 1)
        self.chunks = [lambda x, y: ((lin(x).squeeze(1) - y) ** 2).mean() * 1.7]
        self.plan, self.pipeline = SimpleNamespace(layout=SimpleNamespace(pp=1)), None
        self.micro_batches, self.device = m, torch.device("cpu")
        self.env = SimpleNamespace(rank=0)
        self.loader = _Loader()
        self.get_batch = self.loader.get
        self.grads = SimpleNamespace(no_sync=contextlib.nullcontext)
        self.precision = SimpleNamespace(autocast=contextlib.nullcontext,
                                         cast_scope=contextlib.nullcontext)


def test_loss_stays_a_tensor_until_the_gather_and_keeps_its_bits(monkeypatch):
    from mscale.train.metrics import FIELDS, TIMINGS, gather_rank_vectors
    from mscale.train.step import run_micro_batches

    engine, m = _Engine(5), 5
    expect = 0.0  # the host sum the device sum replaces: float64, micro-batch order
    for j in range(m):
        x, y = engine.loader.get(3, j)
        expect += float(engine.chunks[0](x, y).detach())
    expect /= m
    reads = []
    to_float = torch.Tensor.__float__
    monkeypatch.setattr(torch.Tensor, "__float__", lambda t: reads.append(1) or to_float(t))
    loss = run_micro_batches(engine, 3, StepTimer(clock=HostClock(FakeNow())))
    assert reads == [] and isinstance(loss, torch.Tensor) and loss.dtype == torch.float64
    row = gather_rank_vectors(dict.fromkeys(TIMINGS, 0.0), loss, 1)[0]
    loss_at, weight_at = FIELDS.index("loss"), FIELDS.index("loss_weight")
    assert reads == [1] and row[loss_at].item() == expect and row[weight_at].item() == 1.0
