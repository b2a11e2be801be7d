"""TensorBoard scalars: written per attempt, and a failing disk turns them off, never the job."""

from mscale.config.records import MetricsRecord
from mscale.train import tensorboard


def _record(step: int, **extra) -> MetricsRecord:
    return MetricsRecord(step=step, loss=2.0, grad_norm=1.0, clip_threshold=1.0, lr=1e-3,
                         tokens=64, tokens_per_s=100.0, step_time=[0.1, 0.2],
                         compute_time=[0.1, 0.1], comm_wait=[0.0, 0.1], data_time=[0.0, 0.0],
                         **extra)


def test_scalars_land_in_the_attempts_folder(tmp_path):
    log, why_not = tensorboard.open_log(str(tmp_path), 2)
    assert why_not is None
    log.record(_record(1))
    log.record(_record(2, eval_loss=1.5, eval_perplexity=4.48))
    log.close()
    files = list((tmp_path / "tensorboard" / "attempt-002").glob("events.out.tfevents.*"))
    assert files and files[0].stat().st_size > 0


def test_a_write_that_fails_turns_the_log_off_with_one_line(tmp_path):
    lines = []
    log, _ = tensorboard.open_log(str(tmp_path), 1, warn=lines.append)

    class Full:
        def write_event(self, *a, **k):
            raise OSError(28, "No space left on device")

        def close(self):
            raise AssertionError("a failed log is not touched again")

    log._writer = Full()
    log.record(_record(1))  # no exception: training goes on
    log.record(_record(2))
    log.close()
    assert len(lines) == 1 and "No space left on device" in lines[0]


def test_a_remote_run_directory_writes_none_and_says_so():
    log, why_not = tensorboard.open_log("memory://bucket/run", 1)
    assert log is None and "not local" in why_not


def test_a_missing_tensorboardx_writes_none_and_says_how_to_fix_it(tmp_path, monkeypatch):
    """A broken install (the GPU image lacked tensorboardX) must not cost the job: one line."""
    import sys
    for name in [m for m in sys.modules if m.split(".")[0] == "tensorboardX"] + ["tensorboardX"]:
        monkeypatch.setitem(sys.modules, name, None)  # an import of it raises ImportError
    log, why_not = tensorboard.open_log(str(tmp_path), 1)
    assert log is None
    assert "tensorboardX is not installed" in why_not and "tensorboard: false" in why_not
