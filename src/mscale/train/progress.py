"""Progress display on rank 0: a rich progress bar on a terminal, plain lines otherwise.

Best-effort: once its stream is gone (a closed terminal, a reader that went away) the display
goes quiet and training goes on (distributed/stdio.py); metrics.jsonl has every step anyway.
"""

from __future__ import annotations

import sys

from rich.progress import BarColumn, MofNCompleteColumn, Progress, TextColumn, TimeRemainingColumn

from mscale.config.records import MetricsRecord
from mscale.distributed.stdio import BestEffortStream


class ProgressReporter:
    """Shows step, loss and throughput; silent on ranks other than 0."""

    def __init__(self, steps: int, enabled: bool, log_interval: int = 1, stream=None):
        self.steps, self.enabled, self.log_interval = steps, enabled, max(1, log_interval)
        stream = stream or sys.stdout
        self.stream = stream if isinstance(stream, BestEffortStream) else \
            BestEffortStream(stream, "the console")
        self.tty = self.stream.isatty()
        self._bar: Progress | None = None
        self._task = None
        self._since: list[tuple[float, float]] = []  # (tokens, step seconds) since the last line
        self._warmup: tuple[int, float, float] | None = None
        """(step, tokens, seconds) of the attempt's first step until a line is printed: it
        builds kernels and warms the allocator, so a line's mean leaves it out, as the closing
        summary's speed does (train/console.py `Summary`)."""
        self._first = True

    def __enter__(self) -> "ProgressReporter":
        if self.enabled and self.tty:
            from rich.console import Console

            self._bar = Progress(TextColumn("[bold]train"), BarColumn(), MofNCompleteColumn(),
                                 TextColumn("{task.fields[info]}"), TimeRemainingColumn(),
                                 console=Console(file=self.stream))
            self._bar.start()
            self._task = self._bar.add_task("train", total=self.steps, info="")
        return self

    def __exit__(self, *exc) -> None:
        if self._bar is not None:
            self._bar.stop()

    def update(self, rec: MetricsRecord) -> None:
        if not self.enabled:
            return
        info = f"loss {rec.loss:.4f}  gnorm {rec.grad_norm:.3f}  lr {rec.lr:.2e}  "
        if self._bar is not None:
            info += f"{rec.tokens_per_s:,.0f} tok/s  step {max(rec.step_time):.3f}s"
            self._bar.update(self._task, completed=rec.step, info=info)
            return
        if self._first:
            self._first, self._warmup = False, (rec.step, rec.tokens, max(rec.step_time))
        else:
            self._since.append((rec.tokens, max(rec.step_time)))
        if rec.step % self.log_interval == 0 or rec.step == self.steps:
            print(f"step {rec.step}/{self.steps}  {info}{self._pace()}", flush=True,
                  file=self.stream)
            self._since, self._warmup = [], None

    def _pace(self) -> str:
        """Throughput and step time over the steps since the last line, not the printed step's
        alone: every 50th step pauses for the synchronized garbage collection, so with
        ``--log-interval 50`` each line showed that step, 589 tok/s in a run of 3,400. The
        attempt's first step is left out when others follow it in the line (its warm-up made
        the first line's mean of 50 steps read as a slow start); a line of it alone shows it."""
        left_out = self._warmup is not None and bool(self._since)
        steps = self._since or [self._warmup[1:]]
        tokens, seconds = (sum(v) for v in zip(*steps))
        n = len(steps)
        pace = f"{tokens / seconds:,.0f} tok/s  step {seconds / n:.3f}s" if seconds > 0 else \
            f"{tokens:,.0f} tokens"
        notes = ([f"mean of {n} steps"] if n > 1 else []) + \
            ([f"step {self._warmup[0]} left out: warm-up"] if left_out else [])
        return pace + (f" ({'; '.join(notes)})" if notes else "")
