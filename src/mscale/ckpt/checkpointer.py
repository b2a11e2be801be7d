"""Checkpoints inside `mscale train`: when to save, the two-stage save, commit, resume.

Every method is called by every rank at the same step boundary (the loop's decisions are already
agreed by all ranks), so the small collectives here line up.

Rules (docs/ckpt.md):
- A save is due at every ``interval`` steps, on a control/checkpoint request, before a halt, and
  at the end of training; at most one per step.
- `save` returns at once: the host copy runs on the writer thread during the next step's
  forward/backward, and that step's optimizer update waits for it if it is not done
  (snapshot.py); then the write follows. The blocking time reported is the save call plus that
  wait.
- A save requested while the previous one is still being written first *waits* for it (and its
  commit), then snapshots: at most one snapshot lives in host memory, and a halt's save is never
  skipped. The wait is counted in the new save's blocking time and reported.
- A failed background write does not stop training by itself: rank 0 records a
  ``checkpoint_failed`` event with every failing rank's error, removes the attempt, and
  ``latest`` keeps naming the previous checkpoint. Except a full disk (ENOSPC/EDQUOT, on any
  rank, in a write or the commit): space does not come back by itself, and every step trained on
  is work that cannot be saved, so rank 0 sets `fatal` and the loop stops every rank at the next
  step boundary with exit 3 (docs/train.md); `mscale recover` resumes from ``latest``.
- Right before each commit rank 0 asks whether the run's lock is still this job's (``lock_lost``,
  one small read): a job stopped past its lease (SIGSTOP, a hung mount) may find the run taken
  over by another job. Then nothing is committed, the attempt is left to the run's new owner
  (not removed: a directory of that name may be its own save of the same step), and the job
  stops at the next step boundary with exit 3, the lost lock's code.
"""

from __future__ import annotations

import time
from concurrent import futures
from datetime import timedelta
from functools import partial
from typing import Callable

import torch
import torch.distributed as dist

from mscale.ckpt import catalog, commit
from mscale.ckpt.agree import WAIT_POLL_S, agree
from mscale.ckpt.committer import Committer, Emit, InFlight
from mscale.ckpt.live import LiveRank
from mscale.ckpt.locate import likely_writers
from mscale.ckpt.load import CheckpointReader, has_optimizer, install, read_for_rank
from mscale.ckpt.manifest import MANIFEST, RNG, TrainState, tensor_key
from mscale.ckpt.options import CkptOptions
from mscale.ckpt.ownership import Item, RankLayout, from_live, layout_record, write_items
from mscale.ckpt.resume import ResumePoint, choose_resume
from mscale.ckpt.snapshot import CopyGate, HostArena, ready_event, rng_states, set_rng_states
from mscale.ckpt.writer import BackgroundWriter, WriteHooks, snapshot_and_write
from mscale.config.base import validate
from mscale.config.plan import Plan
from mscale.runs.atomic import is_disk_full


class Checkpointer:
    """One per training process; see the module docstring for the rules."""

    def __init__(self, live: LiveRank, run_ckpt: str, options: CkptOptions, emit: Emit,
                 data_fingerprint: int | None = None, data_sources: list[dict] | None = None,
                 data_position: Callable[[int], int] | None = None,
                 write_hooks: Callable[[int], WriteHooks | None] = lambda step: None,
                 lock_lost: Callable[[], str | None] = lambda: None):
        """``write_hooks(step)``: what the writer of the save of ``step`` calls before its copy
        and after each chunk (`writer.WriteHooks`; the job's fault injection installs them).
        ``lock_lost()``: why this job no longer holds its run directory, None while it does
        (rank 0 asks before each commit; `RunSession.lock_lost`)."""
        self.live, self.root, self.opts, self.emit = live, run_ckpt, options, emit
        self.write_hooks = write_hooks
        self.rank = live.groups.rank
        self.world = live.groups.placement.world
        self.interval = options.interval_for(live.plan)
        """Steps between saves in force (the option, the plan's setting or its advice)."""
        # its own gloo group, with the job's --timeout: gloo's default is 30 minutes, and a rank
        # that never reaches the commit must fail the job as fast as any other collective
        self.group = (dist.new_group(backend="gloo", timeout=timedelta(seconds=live.timeout_s))
                      if dist.is_initialized() else None)
        self.layout = from_live(live)
        self.items = write_items(self.layout) + self._rng_items()
        self.arena = HostArena()
        self.writer = BackgroundWriter()
        self.inflight: InFlight | None = None
        self.commit_future = None
        self.last_step: int | None = None
        self.resumed_from: str | None = None
        """The checkpoint `resume` loaded (for the console's resume line)."""
        self.resumed_state: TrainState | None = None
        """That checkpoint's train state: where the loader counts the data from."""
        self.resumed_model: dict | None = None
        """That checkpoint's ``plan.model`` (train/resumed.py `model_note`)."""
        self.resume_cleaned: list[str] = []
        """What the resume tidied in the checkpoint folder (ckpt/resume.py `tidy`): the console
        says it, since a rollback moves newer checkpoints aside."""
        self.data_position = data_position
        """Samples consumed before a step (the loader's `consumed_before`); None: step · batch."""
        self.fingerprint, self.data_sources = data_fingerprint, data_sources
        self.gate: CopyGate | None = None
        self.commits = Committer(run_ckpt, options.keep, emit, lock_lost)
        """Rank 0: how each save ended (`fatal`, `unsaved_end`)."""

    @property
    def fatal(self) -> str | None:
        """Rank 0: why the job must stop (`Committer.fatal`), read by the loop at a step
        boundary; None while it may go on."""
        return self.commits.fatal

    def unsaved_end(self, step: int) -> str | None:
        """Rank 0, after `close`: why the save of ``step`` (the run's last) was not kept, or
        None (`Committer.unsaved_end`)."""
        return self.commits.unsaved_end(step)

    # ------------------------------------------------------------------ what a rank writes
    def _rng_items(self) -> list[Item]:
        out = []
        for kind, t in rng_states(self.live.device).items():
            n = t.numel()
            out.append(Item(tensor_key(f"{RNG}.{kind}", f"rank-{self.rank:05d}"), (n,), "uint8",
                            ((0, n),), (0, n), ("rng", kind)))
        return out

    def _sources(self) -> list[torch.Tensor]:
        return sources(self.live, self.layout, self.items)

    # ------------------------------------------------------------------ saving
    def due(self, step: int, requested: bool = False, final: bool = False) -> str | None:
        """Why a save is due after ``step`` (1-based steps done), or None."""
        if self.last_step == step:
            return None
        if requested:
            return "request"
        if final and self.opts.final:
            return "final"
        if self.interval and step % self.interval == 0:
            return "interval"
        return None

    def save(self, step: int, reason: str, lr: float | None = None) -> None:
        """Start a save of the state after ``step``. Returns at once: the host copy runs on the
        writer thread and only the next optimizer step waits for it (`before_update`); the write
        follows. Collective when a previous save is still in flight (it is finished first)."""
        t0 = time.perf_counter()
        self.wait()
        self._settle_commit()
        waited = time.perf_counter() - t0
        self.live.optimizer.wait_params()  # parameter all-gathers left in flight by the step
        state = self._train_state(step, lr)
        tensors = self._sources()
        self.gate = CopyGate()
        name = catalog.step_dir(step)
        future = self.writer.submit(
            snapshot_and_write, self.arena, self.gate, self.items, tensors, ready_event(tensors),
            catalog.join(self.root, name), self.rank, self.opts.codec, self.opts.level,
            self.opts.chunk_bytes, device=self.live.device, hooks=self.write_hooks(step))
        self.inflight = InFlight(step, name, reason, future, self.gate,
                                  time.perf_counter() - t0, waited, state)
        self.last_step = step

    def before_update(self) -> None:
        """Run before every optimizer update (`train_step(before_update=...)`): the optimizer may
        change the state only once the save in flight has copied it."""
        if self.gate is not None:
            self.gate.wait()

    def _settle_commit(self) -> None:
        """Rank 0 finishes the previous commit, and no rank starts writing the next checkpoint
        before that: a new save filling the disk must not starve the previous one's manifest."""
        if self.rank == 0 and self.commit_future is not None:
            self.commit_future.exception()
        commit.status(False, False, self.group)

    def _train_state(self, step: int, lr: float | None) -> TrainState:
        live = self.live
        samples = (self.data_position(step) if self.data_position is not None
                   else step * live.plan.training.global_batch)
        return TrainState(step=step, samples=samples,
                          counts_skips=self.data_position is not None,
                          optimizer=live.optimizer.kind, optimizer_step=live.optimizer.step_count,
                          lr=lr, clip=live.clipper.state_dict(), data_fingerprint=self.fingerprint,
                          data_sources=self.data_sources, rng_world=self.world)

    def poll(self) -> None:
        """Collective, every step boundary: commit the in-flight save once every rank is done."""
        if self.inflight is None:
            return
        f = self.inflight.future
        writing, failed = commit.status(not f.done(), f.done() and f.exception() is not None,
                                        self.group)
        if writing == 0:
            self._finish(failed)

    def wait(self) -> None:
        """Collective: block until the in-flight save is written and committed (or failed).

        The ranks ask each other every `WAIT_POLL_S` whether any is still writing, and sleep in
        between: a rank whose write is slow (one node's mount, a loaded store) keeps the others
        waiting out of any collective, where --timeout would fail them, while a rank that stops
        answering still fails a poll within --timeout. Rank 0 says so every --timeout seconds
        the wait lasts."""
        fl = self.inflight
        if fl is None:
            return
        f, t0, said = fl.future, time.monotonic(), 0
        while True:
            writing, failed = commit.status(not f.done(), f.done() and f.exception() is not None,
                                       self.group)
            if writing == 0:
                break
            futures.wait([f], timeout=WAIT_POLL_S) if not f.done() else time.sleep(WAIT_POLL_S)
            waited = time.monotonic() - t0
            if self.rank == 0 and waited >= (said + 1) * self.live.timeout_s:
                said += 1
                self.emit(kind="info", severity="warning", step=fl.step,
                          message=f"checkpoint {fl.name}: {writing} rank(s) still writing after "
                                  f"{waited:.0f} s; training waits for the write to end",
                          evidence={"still_writing": writing, "waited_s": round(waited, 1)})
        self._finish(failed)
        if self.commit_future is not None:
            self.commit_future.exception()
        self.commit_future = None

    def _report(self, fl: InFlight) -> dict:
        error = fl.future.exception()
        report = {"rank": self.rank, "blocking_s": fl.call_s + fl.gate.waited_s,
                  "gate_waited_s": fl.gate.waited_s, "waited_s": fl.waited_s}
        if error is not None:
            report["error"] = f"{type(error).__name__}: {error}"
            report["disk_full"] = is_disk_full(error)
            return report
        res, copy_s = fl.future.result()
        report.update(shard=res.info, write_s=res.seconds, copy_s=copy_s, raw_bytes=res.raw_bytes,
                      tensors=commit.reported_tensors(self.items))
        return report

    def _finish(self, failed: int) -> None:
        """Collective at a step boundary: every rank's report gathered to rank 0, whose writer
        thread then decodes them, builds the manifest and commits (`Committer.assemble`).
        Decoding and building on the training thread held every rank at the next collective:
        ~80 s at each commit of 175B on 12,288 ranks in schema 1 (docs/benchmarks.md). A save that failed on ``failed``
        ranks (the status all-reduce's count) is judged here, so that a full disk stops the job
        at this boundary (`fatal`)."""
        fl, self.inflight = self.inflight, None
        raw = commit.gather_raw(self._report(fl), self.group)
        if raw is None:  # not rank 0
            return
        if failed:
            reports = commit.decode_gathered(raw)
            path = self.commits.failed_on(fl, [r for r in reports if "error" in r])
            self.commit_future = self.writer.submit(catalog.remove, path)
            return
        self.commit_future = self.writer.submit(self.commits.assemble, fl, raw,
                                                partial(self._manifest, fl))

    def _manifest(self, fl: InFlight, reports: list[dict]):
        """The manifest of save ``fl`` from every rank's report (rank 0's writer thread)."""
        return commit.build_manifest(
            fl.step, reports, codec=self.opts.codec, level=self.opts.level,
            chunk_bytes=self.opts.chunk_bytes, layout=self._layout_record(),
            plan=self.live.plan.model_dump(mode="json", exclude_none=True), state=fl.state)

    def _layout_record(self) -> dict:
        return layout_record(self.live.plan)

    def close(self) -> None:
        """Finish what is in flight (collective) and stop the writer thread."""
        self.wait()
        self.writer.close()

    # ------------------------------------------------------------------ resuming
    def resume(self, check: Callable[[object], None] = lambda point: None) -> int:
        """Collective: load the checkpoint chosen by ``options.resume``; returns the step to
        continue from (0 for a fresh run). ``check(point)`` runs on rank 0 with the chosen
        `ResumePoint` (its path and manifest; None for a fresh run) before anything is loaded;
        its `MscaleError` stops every rank."""
        def choose() -> ResumePoint | None:
            point = choose_resume(self.root, self.opts.resume)
            check(point)
            return point
        point = agree(choose, self.group, self.rank)
        if point is None:
            return 0
        t0 = time.perf_counter()
        manifest = point.manifest
        opened: list[CheckpointReader] = []

        def read() -> dict:  # the reader too: it reads index files, which may be damaged
            opened.append(CheckpointReader(point.path, manifest,
                                           prefer=self._likely_writers(manifest)))
            return self._read(opened[0])

        try:
            data = agree(read, self.group, self.rank, share=False)
            install(self.live, self.layout, manifest, data)
            self._restore_state(manifest, data)
        finally:
            for reader in opened:
                reader.close()
        reader = opened[0]
        self.last_step = manifest.state.step
        self.resumed_from = point.path
        self.resumed_state = manifest.state
        self.resumed_model = manifest.plan.get("model")
        self.resume_cleaned = list(point.cleaned)
        self.emit(kind="info", severity="info", step=manifest.state.step,
                  message=f"resumed from {point.path} (step {manifest.state.step})",
                  evidence={"path": point.path, "samples": manifest.state.samples,
                            "indexes_read_rank0": reader.indexes_read,
                            "indexes_widened_rank0": reader.widened,
                            "from_layout": manifest.layout,
                            "to_layout": self._layout_record(), "load_s": time.perf_counter() - t0,
                            "bytes_read_rank0": reader.bytes_read, "cleaned": point.cleaned,
                            "model_only": "optim" not in data})
        return manifest.state.step

    def _likely_writers(self, manifest) -> set[int]:
        """The shards whose indexes this rank reads first at resume (`likely_writers`)."""
        saved = validate(Plan, manifest.plan, MANIFEST, prefix="plan.")  # checked when parsed
        return likely_writers(saved, self.live.plan, self.layout, has_optimizer(manifest))

    def _read(self, reader: CheckpointReader) -> dict:
        """Every file read of a resume (no collectives): state, and the RNG states when the
        layout is the one that saved them (per-rank streams mean nothing at another layout)."""
        data = read_for_rank(reader, self.layout, self.live.optimizer)
        m = reader.manifest
        if m.layout == self._layout_record() and m.state.rng_world == self.world:
            data["rng"] = {}
            for kind in ("cpu", "cuda"):
                key = tensor_key(f"{RNG}.{kind}", f"rank-{self.rank:05d}")
                if reader.has(key):
                    data["rng"][kind] = reader.read_full(key)
        return data

    def _restore_state(self, manifest, data: dict) -> None:
        if manifest.state.clip:
            self.live.clipper.load_state_dict(manifest.state.clip)
        if "rng" in data:
            set_rng_states(data["rng"], self.live.device)

def sources(live: LiveRank, layout: RankLayout, items: list[Item]) -> list[torch.Tensor]:
    """The live tensors (views, not copies) behind each item of a rank's write set."""
    opt, rng = live.optimizer, rng_states(live.device)
    out = []
    for it in items:
        if it.source[0] == "param":
            out.append(live.params[it.source[1]])
        elif it.source[0] == "optim":
            pc = layout.pieces[it.source[2]]
            out.append(getattr(opt, it.source[1])[pc.owned_lo: pc.owned_lo + it.count])
        else:
            out.append(rng[it.source[1]])
    return out
