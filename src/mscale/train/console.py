"""What the operator reads: a start line, a closing summary, and one line on every abnormal stop.

Rank 0 prints these (other ranks write to their logs). Each line says what happened and where
the evidence is, so an operator reading a SLURM log knows why the job ended without opening
anything else. Formatting lives here so the loop reads as a loop.
"""

from __future__ import annotations

from dataclasses import dataclass, field

from mscale.config.plan import Plan
from mscale.ckpt.listing import format_bytes
from mscale.config.records import MetricsRecord


def layout_text(plan: Plan) -> str:
    """``tp2·pp2·dp2`` (with ``·vpp2`` when interleaved)."""
    lay = plan.layout
    text = f"tp{lay.tp}·pp{lay.pp}·dp{lay.dp}"
    vpp = getattr(lay, "vpp", 1) or 1
    return text + (f"·vpp{vpp}" if vpp > 1 else "")


def start_line(plan: Plan, world: int, launcher: str, run_dir: str, run_id: str, attempt: int,
               device: str) -> str:
    processes = f"{world} process" + ("es" if world != 1 else "")
    return (f"training {plan.name}: {layout_text(plan)} on {processes} ({launcher}, {device}), "
            f"run {run_id} attempt {attempt}, run directory {run_dir}")


def resume_text(resumed_from: str | None, step: int, steps: int,
                own: bool = True) -> str | None:
    """The resume line, or None when nothing was loaded. Keyed on the checkpoint loaded, not on
    its step: an HF import (`mscale ckpt convert HF_DIR DST --plan PLAN`) is step 0, and a run
    started from one must say so as loudly as any other resume. ``own``: the checkpoint is the
    run directory's own (not another run's, given with ``--resume PATH``)."""
    return None if resumed_from is None else resume_line(resumed_from, step, steps, own)


def moved_aside_line(cleaned: list[str], ckpt_dir: str) -> str | None:
    """What a rollback did to the newer checkpoints (ckpt/resume.py `tidy`), or None: they are
    moved aside, not deleted, and would otherwise vanish from `ckpt ls` in silence."""
    moved = [c for c in cleaned if c.startswith("moved ")]
    if not moved:
        return None
    return (f"{'; '.join(moved)}: kept in {ckpt_dir} (not listed by `mscale ckpt ls`, not "
            "resumed from); delete them when they are no longer wanted")


def resume_line(path: str, step: int, steps: int, own: bool = True) -> str:
    if step < steps:
        return f"resumed from {path} (step {step}); continuing to step {steps}"
    reached = f"at step {steps}" if step == steps else f"past step {steps}"
    # another run's checkpoint only starts this run: its run directory is already a new one
    over = "use a new --run-dir to start over" if own else \
        "leave out --resume to train this run from step 0"
    return (f"resumed from {path} (step {step}): training.steps is {steps} and the run is "
            f"already {reached}, nothing to train (raise --steps, or {over})")


def checkpoint_line(kind: str, message: str, evidence: dict) -> str | None:
    """The console line of a checkpoint event (None for other events): a commit with its size
    and what it cost the training, a failure as the event says it (what happens next
    included). A failed save used to reach only events.jsonl."""
    said = ("still_writing", "retention_error", "commit_error")  # warnings a save raises
    if kind == "checkpoint_failed" or (kind == "info" and any(k in evidence for k in said)):
        return f"WARNING {message}"
    if kind != "checkpoint":
        return None
    size = evidence.get("stored_bytes")
    took, blocked = evidence.get("total_s"), evidence.get("blocking_s_max")
    parts = [format_bytes(size) if size is not None else None,
             f"{took:.1f} s in the background" if took is not None else None,
             f"training blocked {blocked:.2f} s" if blocked is not None else None]
    return message + "".join(f"; {p}" if i else f": {p}"
                             for i, p in enumerate(p for p in parts if p))


@dataclass
class Summary:
    """Figures for the closing line, accumulated from rank 0's metrics records.

    Speed (tokens/s, MFU) is the steady state: the attempt's first step is left out when more
    followed, since it builds kernels (torch.compile, cuBLAS autotuning) and warms the allocator;
    a compiled GPU run spends a minute there, which would halve a short run's average. The line
    names that step's time when it stood out."""

    first_step: int
    records: int = 0
    last: MetricsRecord | None = None
    tokens: int = 0
    seconds: float = 0.0
    mfu: list[float] = field(default_factory=list)
    eval_loss: float | None = None
    """The last held-out loss of this attempt."""
    warmup: tuple[int, float, float | None] | None = None
    """(tokens, seconds, MFU) of the attempt's first step, kept apart from the sums above."""

    def add(self, rec: MetricsRecord) -> None:
        self.records += 1
        if rec.eval_loss is not None:
            self.eval_loss = rec.eval_loss
        self.last = rec
        seconds = max(rec.step_time) if rec.step_time else 0.0
        if self.warmup is None:
            self.warmup = (rec.tokens, seconds, rec.mfu)
            return
        self.tokens += rec.tokens
        self.seconds += seconds
        if rec.mfu is not None:
            self.mfu.append(rec.mfu)

    def _speed(self) -> tuple[int, float, list[float]]:
        """(tokens, seconds, MFUs) of the steady steps, or of the first when it was alone."""
        if self.records == 1 and self.warmup is not None:
            tokens, seconds, mfu = self.warmup
            return tokens, seconds, [] if mfu is None else [mfu]
        return self.tokens, self.seconds, self.mfu

    def as_dict(self) -> dict:
        """The figures as a JSON-ready dict (``mscale train --json``)."""
        last = self.last
        tokens, seconds, mfu = self._speed()
        return {"first_step": self.first_step, "last_step": last.step if last else self.first_step,
                "steps_this_attempt": self.records,
                "final_loss": last.loss if last else None,
                "eval_loss": self.eval_loss,
                "tokens_per_s": tokens / seconds if seconds else None,
                "mfu": sum(mfu) / len(mfu) if mfu else None,
                "first_step_s": self.warmup[1] if self.warmup else None}

    def line(self, checkpoint: str | None, run_dir: str) -> str:
        d = self.as_dict()
        if not self.records:
            core = f"no step trained (at step {self.first_step})"
        else:
            core = (f"steps {self.first_step + 1}-{d['last_step']}, final loss {d['final_loss']:.4f}, "
                    f"{d['tokens_per_s']:,.0f} tokens/s")
            if d["eval_loss"] is not None:
                core += f", eval loss {d['eval_loss']:.4f}"
            if d["mfu"] is not None:
                core += f", MFU {100 * d['mfu']:.1f}%"
            steady = self.seconds / (self.records - 1) if self.records > 1 else None
            if steady and d["first_step_s"] > 2 * steady:
                core += (f" (step {self.first_step + 1} left out: {d['first_step_s']:.1f} s "
                         "of warm-up)")
        ckpt = f"last checkpoint {checkpoint}" if checkpoint else "no checkpoint"
        return f"{core}; {ckpt}; run directory {run_dir}"


def stop_line(reason: str, step: int, events: str | None, detail: str = "",
              signal_name: str | None = None) -> str:
    """One line for a stop that is not a clean finish (reason: nan, halt, signal, abort).
    ``signal_name``: the stop signal this rank saw (another rank may have seen it alone)."""
    which = f" ({signal_name})" if signal_name else ""
    text = {
        "nan": f"stopped at step {step}: non-finite gradient norm, the optimizer step was not taken",
        "halt": f"stopped at step {step}: halt requested through control/halt",
        "signal": f"stopped at step {step}: a stop signal{which} asked the job to halt",
    }.get(reason, f"stopped at step {step}")
    sep = "; " if reason in _KNOWN else ": "
    where = f"; evidence in {events}" if events else ""
    return f"{text}{sep + detail if detail else ''}{where}"


_KNOWN = ("nan", "halt", "signal")
