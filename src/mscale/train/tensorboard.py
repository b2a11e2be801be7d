"""TensorBoard scalars of a run: ``tensorboard --logdir runs/`` works as users expect.

Rank 0 turns each metrics record into a few scalars (loss, eval loss, grad norm, lr, tokens/s,
MFU, and the mean per-rank step, compute, communication, data and bubble seconds) and writes
them with tensorboardX, a small writer with no server and no network. Each attempt of a run gets
its own folder (``RUN/tensorboard/attempt-NNN``): TensorBoard shows a resumed run as curves
that continue, and a step repeated after a rollback as the later attempt's, not a zigzag.
metrics.jsonl stays the record of truth; this is a view of it.
"""

from __future__ import annotations

import os
import time

from mscale.config.records import MetricsRecord

SCALARS = {"train/loss": "loss", "train/grad_norm": "grad_norm", "train/lr": "lr",
           "perf/tokens_per_s": "tokens_per_s", "perf/mfu": "mfu"}
"""Tag → record field."""
TIMES = {"time/step_s": "step_time", "time/compute_s": "compute_time", "time/comm_wait_s":
         "comm_wait", "time/data_s": "data_time", "time/bubble_s": "bubble_time"}
"""Tag → per-rank vector, shown as its mean over ranks."""


def folder(run_root: str, attempt: int) -> str:
    return os.path.join(run_root, "tensorboard", f"attempt-{attempt:03d}")


class ScalarLog:
    """The TensorBoard event file of one attempt, written by rank 0.

    A view must never stop the job: a write that fails (a full disk, a lost mount) turns the log
    off with one line through ``warn``, and training goes on; metrics.jsonl, whose journal
    handles a full disk as a stop agreed by every rank, still has every figure.

    Written in the caller's thread with tensorboardX's plain event writer, not its
    ``SummaryWriter``: that one writes from a background thread, which on a full disk died with a
    traceback on rank 0's console, where no guard of ours could catch it. A few hundred bytes per
    step cost nothing to write inline; the file is flushed every ``FLUSH_S`` and at the end."""

    FLUSH_S = 10.0

    def __init__(self, path: str, warn=print):
        from tensorboardX.event_file_writer import EventsWriter  # imports no torch
        from tensorboardX.proto.event_pb2 import Event
        from tensorboardX.proto.summary_pb2 import Summary

        self._event, self._summary = Event, Summary  # imported once, used every step
        self.path, self.warn = path, warn
        os.makedirs(path, exist_ok=True)
        self._writer = EventsWriter(os.path.join(path, "events"))
        self._flushed = time.monotonic()

    def record(self, rec: MetricsRecord) -> None:
        self._guarded(self._record, rec)

    def scalar(self, tag: str, value: float, step: int) -> None:
        """One value outside a metrics record (the held-out loss before the first step)."""
        self._guarded(self._write, {tag: value}, step, time.time())

    def close(self) -> None:
        self._guarded(lambda: self._writer.close())
        self._writer = None

    def _record(self, rec: MetricsRecord) -> None:
        values = {tag: getattr(rec, name) for tag, name in SCALARS.items()}
        for tag, name in TIMES.items():
            per_rank = getattr(rec, name)
            values[tag] = sum(per_rank) / len(per_rank) if per_rank else None
        if rec.eval_loss is not None:
            values["eval/loss"], values["eval/perplexity"] = rec.eval_loss, rec.eval_perplexity
        self._write(values, rec.step, rec.time)

    def _write(self, values: dict[str, float | None], step: int, walltime: float) -> None:
        summary = self._summary(value=[self._summary.Value(tag=tag, simple_value=float(v))
                                       for tag, v in values.items() if v is not None])
        self._writer.write_event(self._event(wall_time=walltime, step=step, summary=summary))
        if time.monotonic() - self._flushed > self.FLUSH_S:
            self._writer.flush()
            self._flushed = time.monotonic()

    def _guarded(self, fn, *args) -> None:
        if self._writer is None:
            return
        try:
            fn(*args)
        except OSError as e:
            self._writer = None
            self.warn(f"TensorBoard scalars stopped: {self.path}: {e.strerror or e} "
                      "(training goes on; metrics.jsonl has every figure)")


def open_log(run_root: str, attempt: int, warn=print) -> tuple[ScalarLog | None, str | None]:
    """(the log, None), or (None, why not) for a run directory that is not a local folder:
    tensorboardX writes local files (metrics.jsonl still has every figure)."""
    if "://" in run_root and not run_root.startswith("file://"):
        return None, (f"TensorBoard scalars are not written: the run directory {run_root} is "
                      "not local (metrics.jsonl has the same figures)")
    root = run_root.removeprefix("file://")
    try:
        return ScalarLog(folder(root, attempt), warn), None
    except OSError as e:  # the folder cannot be made (a full disk, read-only): not a reason to stop
        return None, f"TensorBoard scalars are not written: {e} (metrics.jsonl has every figure)"
    except ImportError as e:  # a broken install (it is a dependency): a view, not worth a job
        return None, (f"TensorBoard scalars are not written: tensorboardX is not installed ({e}; "
                      "pip install tensorboardX, or training.tensorboard: false; metrics.jsonl "
                      "has every figure)")
