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

import contextlib
import errno
import time
from concurrent import futures
from dataclasses import dataclass, field
from datetime import timedelta
from typing import Callable

import torch
import torch.distributed as dist

from mscale.ckpt import catalog, commit
from mscale.ckpt.live import LiveRank
from mscale.ckpt.load import CheckpointReader, has_optimizer, install, read_for_rank
from mscale.ckpt.manifest import MANIFEST, RNG, TrainState, tensor_key
from mscale.ckpt.options import CkptOptions
from mscale.ckpt.ownership import (Item, RankLayout, from_live, layout_record, likely_writers,
                                   write_items)
from mscale.ckpt.resume import ResumePoint, choose_resume
from mscale.ckpt.snapshot import CopyGate, HostArena, ready_event, rng_states, set_rng_states
from mscale.ckpt.writer import BackgroundWriter, WriteHooks, snapshot_and_write
from mscale.config.base import validate
from mscale.config.plan import Plan
from mscale.errors import EXIT_BAD_INPUT, MscaleError
from mscale.runs.atomic import DiskFullError


@dataclass
class _InFlight:
    step: int
    name: str
    reason: str
    future: object
    gate: CopyGate
    call_s: float
    """Seconds the save call itself took (waiting for a previous save included)."""
    waited_s: float
    state: TrainState
    started: float = field(default_factory=time.perf_counter)


Emit = Callable[..., None]
"""``emit(kind=, severity=, step=, message=, evidence=)``: appends an event (rank 0 only)."""


WAIT_POLL_S = 0.2
"""Seconds between two polls of the ranks waiting for a save to be written (`wait`)."""


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
        self.write_hooks, self.lock_lost = write_hooks, lock_lost
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
        self.inflight: _InFlight | None = None
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
        self.fatal: str | None = None
        """Rank 0: why the job must stop (a save failed on a full disk, a commit was refused);
        None while it may go on. Set on the training or the writer thread, read by the loop at a
        step boundary."""
        self.refused: str | None = None
        """Rank 0: why a commit was refused (the run's lock is another job's now); then no
        resume from here is this job's to make (`unsaved_end`)."""
        self.failed: dict[int, str] = {}
        """Rank 0: the steps whose save failed, each with the failure's message; read after
        `close` to tell whether the save that ended the run (final, or a halt's) was kept."""

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
        self.inflight = _InFlight(step, name, reason, future, self.gate,
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

    def _report(self, fl: _InFlight) -> dict:
        error = fl.future.exception()
        report = {"rank": self.rank, "blocking_s": fl.call_s + fl.gate.waited_s,
                  "gate_waited_s": fl.gate.waited_s, "waited_s": fl.waited_s}
        if error is not None:
            report["error"] = f"{type(error).__name__}: {error}"
            report["disk_full"] = disk_full(error)
            return report
        res, copy_s = fl.future.result()
        report.update(shard=res.info, write_s=res.seconds, copy_s=copy_s, raw_bytes=res.raw_bytes,
                      tensors=commit.reported_tensors(self.items))
        return report

    def _finish(self, failed: int) -> None:
        """Collective at a step boundary: every rank's report gathered to rank 0, whose writer
        thread then decodes them, builds the manifest and commits (`_assemble`). Decoding and
        building on the training thread held every rank at the next collective: ~80 s at each
        commit of 175B on 12,288 ranks (docs/benchmarks.md). A save that failed on ``failed``
        ranks (the status all-reduce's count) is judged here, so that a full disk stops the job
        at this boundary (`fatal`)."""
        fl, self.inflight = self.inflight, None
        raw = commit.gather_raw(self._report(fl), self.group)
        if raw is None:  # not rank 0
            return
        if failed:
            reports = commit.decode_gathered(raw)
            path = self._failed(fl, [r for r in reports if "error" in r])
            self.commit_future = self.writer.submit(catalog.remove, path)
            return
        self.commit_future = self.writer.submit(self._assemble, fl, raw)

    def _assemble(self, fl: _InFlight, raw: list[bytes]) -> None:
        """Rank 0's writer thread: the gathered reports (none failed: `_finish` judged those) →
        manifest → commit. An error here is a failed commit (an event, the attempt removed),
        never an exception left unread in the writer's future."""
        try:
            reports = commit.decode_gathered(raw)
            del raw
            manifest = commit.build_manifest(
                fl.step, reports, codec=self.opts.codec, level=self.opts.level,
                chunk_bytes=self.opts.chunk_bytes, layout=self._layout_record(),
                plan=self.live.plan.model_dump(mode="json", exclude_none=True), state=fl.state)
            evidence = _evidence(fl, reports)
        except Exception as e:  # noqa: BLE001 - reported as `_commit` reports its own errors
            self._not_committed(fl, e, {"reason": fl.reason})
            return
        del reports
        self._commit(fl, manifest, evidence)

    def _commit(self, fl: _InFlight, manifest, evidence: dict) -> None:
        try:
            result = commit.commit(self.root, fl.name, manifest, self.opts.keep, self.lock_lost)
        except commit.CommitRefused as e:
            self._refused(fl, str(e), evidence)
            return
        except Exception as e:  # noqa: BLE001 - a failed commit is an event, not a crash
            latest = self._latest()
            if latest == fl.name:  # the pointer moved before the error: the checkpoint stands
                self._committed(fl, evidence, {"commit_error": f"{type(e).__name__}: {e}"})
                return
            self._not_committed(fl, e, evidence, latest)
            return
        self._committed(fl, evidence, result)

    def _not_committed(self, fl: _InFlight, e: Exception, evidence: dict,
                       latest: str | None = None) -> None:
        """A save written on every rank that failed before ``latest`` named it: the attempt is
        removed, `failed` and a critical event say why (a full disk also sets `fatal`)."""
        latest = latest if latest is not None else self._latest()
        with contextlib.suppress(Exception):  # a dead attempt; the next start removes it too
            catalog.remove(catalog.join(self.root, fl.name))
        then = self._then(fl, latest, disk_full(e))
        self.failed[fl.step] = f"checkpoint {fl.name} written but not committed: {e}"
        self.emit(kind="checkpoint_failed", severity="critical", step=fl.step,
                  message=f"{self.failed[fl.step]}; {then}",
                  evidence={**evidence, "error": f"{type(e).__name__}: {e}",
                            "latest": latest, "action": "attempt removed"})

    def _refused(self, fl: _InFlight, why: str, evidence: dict) -> None:
        """The run's lock is another job's now (module docstring): the attempt stays as it is,
        and `fatal` stops the job, since every later commit would be refused too."""
        self.refused = self.fatal = f"{why}: checkpoint step {fl.step} not committed"
        self.emit(kind="checkpoint_failed", severity="critical", step=fl.step,
                  message=f"{self.refused}; this job stops (exit 3)",
                  evidence={**evidence, "error": why, "latest": self._latest(),
                            "action": "attempt left uncommitted to the run's owner"})

    def _committed(self, fl: _InFlight, evidence: dict, result: dict) -> None:
        self.emit(kind="checkpoint", severity="info", step=fl.step,
                  message=f"checkpoint {fl.name} committed ({fl.reason})",
                  evidence={**evidence, **result, "total_s": time.perf_counter() - fl.started})
        trouble = (result.get("retention_error") or result.get("commit_error")
                   or result.get("lock_check_error"))
        if trouble:  # the checkpoint is good; what failed around it is said, not hidden
            what = ("deleting older checkpoints (retention) failed; they are kept until the "
                    "next commit" if "retention_error" in result else
                    "an error came after latest was moved to it" if "commit_error" in result
                    else "the run's lock.json could not be read before it (committed: the "
                    "lock's heartbeat still watches for a takeover)")
            self.emit(kind="info", severity="warning", step=fl.step,
                      message=f"checkpoint {fl.name} committed, but {what}: {trouble}",
                      evidence={"path": catalog.join(self.root, fl.name), **result})

    def _failed(self, fl: _InFlight, failed: list[dict]) -> str:
        """Record a save that failed on some ranks; returns its directory, for the caller to
        remove."""
        path = catalog.join(self.root, fl.name)
        latest = self._latest()
        then = self._then(fl, latest, any(r.get("disk_full") for r in failed))
        self.failed[fl.step] = (f"checkpoint {fl.name} failed on {len(failed)} rank(s): "
                                f"{failed[0]['error']}")
        self.emit(kind="checkpoint_failed", severity="critical", step=fl.step,
                  ranks=[r["rank"] for r in failed],
                  message=f"{self.failed[fl.step]}; {then}",
                  evidence={"path": path, "reason": fl.reason, "latest": latest,
                            "errors": {str(r["rank"]): r["error"] for r in failed[:16]},
                            "action": "attempt removed"})
        return path

    def _then(self, fl: _InFlight, latest: str | None, full: bool) -> str:
        """What happens after a failed save (module docstring); a full disk sets `fatal`."""
        keep = f"latest stays {latest or '(none yet)'}"
        if not full:
            return f"training continues, {keep}"
        self.fatal = (f"checkpoint {fl.name} failed: the disk is full; {keep}; free space on "
                      f"{self.root}, then resume")
        return f"the job stops at the next step boundary (a full disk), {keep}"

    def unsaved_end(self, step: int) -> str | None:
        """Rank 0, after `close`: why the save of ``step`` (the run's last) was not kept, or None
        when it was kept or never made. The steps since ``latest`` are then lost with the
        process, which the job's exit code must say (docs/train.md, "Exit codes"). A refused
        commit says why whatever the step: the run is another job's now."""
        if self.refused is not None:
            return self.refused
        if step not in self.failed:
            return None
        return (f"{self.failed[step]}; latest stays {self._latest() or '(none yet)'}: the steps "
                "after it are not saved; fix the checkpoint storage, then the same command "
                "resumes from it")

    def _latest(self) -> str | None:
        """What ``latest`` names, for a failure event (which must not fail in turn)."""
        try:
            return catalog.read_latest(self.root)
        except Exception as e:  # noqa: BLE001 - an unreadable pointer is part of the report
            return f"(unreadable: {e})"

    def _layout_record(self) -> dict:
        return layout_record(self.live.plan)

    def close(self) -> None:
        """Finish what is in flight (collective) and stop the writer thread."""
        self.wait()
        self.writer.close()

    # ------------------------------------------------------------------ resuming
    def resume(self, check: Callable[[object], None] = lambda manifest: None) -> int:
        """Collective: load the checkpoint chosen by ``options.resume``; returns the step to
        continue from (0 for a fresh run). ``check(manifest)`` runs on rank 0 with the chosen
        checkpoint's manifest before anything is loaded; its `MscaleError` stops every rank."""
        def choose() -> ResumePoint | None:
            point = choose_resume(self.root, self.opts.resume)
            check(point.manifest if point is not None else None)
            return point
        point = self._agree(choose)
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
            data = self._agree(read, share=False)
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

    def _likely_writers(self, manifest) -> set[int] | None:
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

    def _agree(self, fn, share: bool = True):
        """Run ``fn`` (rank 0 only when ``share``, then broadcast its result); if it raises on
        any rank, raise the same MscaleError on every rank (exit 3: this run cannot start from
        that checkpoint), before anyone enters a collective the failed rank would never join."""
        result, error = None, None
        run = fn
        if share:
            done = self._rank0_runs(fn)
            run = None if done is None else done.result
        if run is not None:
            try:
                result = run()
            except MscaleError as e:
                error = {"message": e.message, "file": e.file, "field": e.field, "fix": e.fix}
            except Exception as e:  # noqa: BLE001 - reported on every rank, with the rank
                error = {"message": f"rank {self.rank}: {type(e).__name__}: {e}"}
        errors = commit.gather_json(error, self.group)
        first = commit.broadcast_json(next((e for e in errors if e), None) if errors else None,
                                      self.group)
        if first:
            raise MscaleError(first["message"], file=first.get("file"), field=first.get("field"),
                              fix=first.get("fix"), code=EXIT_BAD_INPUT)
        if share:
            shared = commit.broadcast_json(result.to_json() if result else None, self.group)
            return ResumePoint.from_json(shared) if shared else None
        return result

    def _rank0_runs(self, fn) -> futures.Future | None:
        """Collective: rank 0 runs ``fn`` on a thread while every rank asks every `WAIT_POLL_S`
        whether it is done (as `wait` does for a write), so no rank sits in one collective for
        all of it: choosing the checkpoint parses its manifest, which took ~2 minutes at 175B on
        12,288 ranks in schema 1 (0.75 s in schema 2, docs/benchmarks.md), past a 120 s
        --timeout; a slow filesystem can still. Rank 0 gets the future."""
        pool = futures.ThreadPoolExecutor(1, "mscale-resume") if self.rank == 0 else None
        done = pool.submit(fn) if pool is not None else None
        try:
            while commit.status(done is not None and not done.done(), False, self.group)[0]:
                if done is not None:
                    futures.wait([done], timeout=WAIT_POLL_S)
                else:
                    time.sleep(WAIT_POLL_S)
        finally:
            if pool is not None:
                pool.shutdown(wait=False)
        return done


def disk_full(exc: BaseException) -> bool:
    """A full filesystem or quota, however the writer or the commit reported it."""
    if isinstance(exc, DiskFullError):
        return True
    return isinstance(exc, OSError) and exc.errno in (errno.ENOSPC, errno.EDQUOT)


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


def _evidence(fl: _InFlight, reports: list[dict]) -> dict:
    stored = sum(r["shard"]["bytes"] for r in reports)
    raw = sum(r.get("raw_bytes", 0) for r in reports)
    write_s = max(r.get("write_s", 0.0) for r in reports)
    return {"reason": fl.reason, "blocking_s_max": max(r["blocking_s"] for r in reports),
            "update_waited_s_max": max(r["gate_waited_s"] for r in reports),
            "copy_s_max": max(r.get("copy_s", 0.0) for r in reports),
            "waited_for_previous_s_max": max(r["waited_s"] for r in reports),
            "write_s_max": write_s, "stored_bytes": stored, "raw_bytes": raw,
            "shards": len(reports), "write_gb_per_s": stored / write_s / 1e9 if write_s else None}
