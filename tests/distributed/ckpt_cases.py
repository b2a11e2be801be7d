"""Drive the real engine with checkpoints inside run_distributed: save, resume at other layouts,
faults. Each rank returns plain data; the tests assemble global tensors themselves (not through
mscale.ckpt), so the checks do not trust the code they test."""

from __future__ import annotations

import torch

from tests.distributed.engine_cases import build_case_engine


def build(rank: int, world: int, case: dict):
    return build_case_engine(rank, world, case)


def checkpointer(engine, root: str, events: list, resume: str = "none", hooks=None, **opts):
    """A Checkpointer of ``engine``; ``hooks``: the writer's `WriteHooks` for every save."""
    from mscale.ckpt.checkpointer import Checkpointer
    from mscale.ckpt.options import CkptOptions

    def emit(**fields):
        if engine.groups.rank == 0:
            events.append(fields)

    opts.setdefault("chunk_bytes", 4096)
    return Checkpointer(engine.live_rank(), root, CkptOptions(resume=resume, **opts), emit,
                        write_hooks=lambda step: hooks)


def steps(engine, first: int, last: int, ckpt=None, save_at=(), wait=False) -> list:
    """Run 0-based steps first..last-1; save after the steps in ``save_at`` (1-based)."""
    from mscale.train.loop import train_step
    from mscale.train.timers import StepTimer

    timer, losses = StepTimer(), []
    for step in range(first, last):
        timer.start_step()
        guard = ckpt.before_update if ckpt is not None else (lambda: None)
        losses.append(train_step(engine, step, timer, before_update=guard).loss)
        timer.end_step()
        if ckpt is not None:
            ckpt.poll()
            if step + 1 in save_at:
                ckpt.save(step + 1, "test")
                if wait:
                    ckpt.wait()
    return losses


def state(engine) -> dict:
    """This rank's model (TP-gathered) and optimizer pieces, by global name."""
    from mscale.parallel.parallelize import full_state_dict
    from mscale.parallel.tensor import TensorParallel

    g = engine.groups
    tp = TensorParallel.from_groups(g, engine.plan.layout.sequence_parallel)
    engine.param_buffer.wait()  # the last step's parameter all-gathers
    params = {k: v.clone() for k, v in full_state_dict(engine.chunks, engine.table, tp).items()}
    opt = engine.optimizer
    pieces = []
    for pc in opt.pieces:
        spec = engine.table[pc.param_index]
        box = [s.indices(d)[:2] for s, d in zip(spec.tp_slice(g.tp_rank, g.tp_size),
                                                spec.global_shape)]
        pieces.append((spec.name, tuple(spec.global_shape), box, pc.param_lo, pc.param_hi,
                       *[getattr(opt, k)[pc.owned_lo: pc.owned_hi].clone()
                         for k in ("master", "exp_avg", "exp_avg_sq")]))
    return {"params": params, "pieces": pieces, "step": opt.step_count,
            "clip": engine.clipper.state_dict(), "coord": (g.dp_rank, g.pp_rank, g.tp_rank),
            "rng": torch.get_rng_state()}


def assemble(states: list[dict]) -> dict:
    """Global model and optimizer tensors from every rank's `state` (independent of mscale.ckpt):
    pieces are written into their TP box's flat range; overlapping copies must agree."""
    model, optim = {}, {}
    for st in states:
        if st["coord"][0] == 0:
            model.update(st["params"])
        for name, shape, box, lo, hi, *values in st["pieces"]:
            for key, v in zip(("master", "exp_avg", "exp_avg_sq"), values):
                full = optim.setdefault(f"{key}/{name}", torch.full(shape, float("nan")))
                region = tuple(slice(a, b) for a, b in box)
                local = full[region].clone().reshape(-1)
                old = local[lo:hi]
                assert torch.isnan(old).all() or torch.equal(old, v), f"{key}/{name} disagrees"
                local[lo:hi] = v
                full[region] = local.view(full[region].shape)
    for k, v in optim.items():
        assert not torch.isnan(v).any(), f"{k} not fully owned by any rank"
    return {"model": model, "optim": optim}


def chain(rank: int, world: int, root: str, layouts: list[dict], start: dict) -> dict:
    """Train ``start`` 2 steps, save, step once more (reference); then for each layout: resume
    from the previous checkpoint, record the state, save it again, step once."""
    events: list = []
    out = {"layouts": []}
    engine = build(rank, world, start)
    ck = checkpointer(engine, f"{root}/start", events)
    steps(engine, 0, 2, ck, save_at=(2,), wait=True)
    out["saved"] = state(engine)
    out["next_loss"] = steps(engine, 2, 3)
    out["next"] = state(engine)
    ck.close()
    engine.grads.close()
    prev = f"{root}/start/step-000002"
    for i, case in enumerate(layouts):
        engine = build(rank, world, case)
        ck = checkpointer(engine, f"{root}/l{i}", events, resume=prev)
        first = ck.resume()
        loaded = state(engine)
        ck.save(first, "test")
        ck.wait()
        losses = steps(engine, first, first + 1)
        out["layouts"].append({"first": first, "loaded": loaded, "loss": losses,
                               "after": state(engine)})
        ck.close()
        engine.grads.close()
        prev = f"{root}/l{i}/step-000002"
    out["events"] = events
    return out


def resume_once(rank: int, world: int, path: str, case: dict) -> dict:
    """Resume ``case`` from ``path`` and take one step."""
    events: list = []
    engine = build(rank, world, case)
    ck = checkpointer(engine, "memory://resume-once/ckpt", events, resume=path)
    first = ck.resume()
    loaded = state(engine)
    loss = steps(engine, first, first + 1)
    ck.close()
    engine.grads.close()
    resumed = [e for e in events if e.get("message", "").startswith("resumed from")]
    return {"first": first, "loaded": loaded, "loss": loss, "after": state(engine),
            "resumed": [e["evidence"] for e in resumed]}


def _failing_write(fail_step: int):
    """A write_shard that fails like a full disk for one step's checkpoint."""
    import errno

    from mscale.ckpt import writer as module

    real = module.write_shard

    def write(ckpt_dir, *args, **kwargs):
        if ckpt_dir.endswith(f"step-{fail_step:06d}"):
            raise OSError(errno.ENOSPC, "No space left on device (injected)")
        return real(ckpt_dir, *args, **kwargs)

    module.write_shard = write


def protocol(rank: int, world: int, root: str, case: dict) -> dict:
    """Async saves while training runs on, a save requested during another, a failing rank,
    retention (keep 3)."""
    import time

    from mscale.ckpt import catalog

    events: list = []
    engine = build(rank, world, case)
    if rank == 2:
        _failing_write(5)
    from mscale.train.faults import CheckpointFaults

    slow = CheckpointFaults(None, chunk_delay_s=0.1, copy_delay_s=1.0)  # a slow filesystem
    ck = checkpointer(engine, f"{root}/ckpt", events, hooks=slow, keep=3, chunk_bytes=64 << 10)
    out = {}
    steps(engine, 0, 2, ck, save_at=(2,))
    out["at2"] = state(engine)
    out["in_flight_after_save"] = ck.inflight is not None
    slow.copy_delay_s = 0.0
    steps(engine, 2, 3, ck, save_at=(3,))  # the step-2 save is still being written
    out["at3"] = state(engine)  # its write goes on (slowly) while steps 4.. change everything
    slow.chunk_delay_s = 0.0
    steps(engine, 3, 7, ck, save_at=(5, 6, 7))
    ck.close()
    out["latest"] = catalog.read_latest(f"{root}/ckpt") if rank == 0 else None
    out["dirs"] = [e.name for e in catalog.entries(f"{root}/ckpt")] if rank == 0 else None
    out["events"] = events
    engine.grads.close()
    return out


def live_logits(rank: int, world: int, root: str, case: dict) -> dict:
    """Train 2 steps, save, and return the full logits of a fixed batch (TP-gathered)."""
    import torch.distributed as dist

    events: list = []
    engine = build(rank, world, case)
    ck = checkpointer(engine, f"{root}/ckpt", events)
    steps(engine, 0, 2, ck, save_at=(2,), wait=True)
    ck.close()
    tokens = torch.randint(0, engine.plan.model.vocab, (2, engine.plan.model.seq_len),
                           generator=torch.Generator().manual_seed(5))
    with torch.no_grad():
        part = engine.chunks[0](tokens).contiguous()
    g = engine.groups
    parts = [torch.empty_like(part) for _ in range(g.tp_size)]
    dist.all_gather(parts, part, group=g.tp_group)
    engine.grads.close()
    return {"logits": torch.cat(parts, dim=-1), "tokens": tokens}


def memory_roundtrip(rank: int, world: int, case: dict) -> dict:
    """One process: save to memory://, resume a fresh engine from it, compare."""
    events: list = []
    engine = build(rank, world, case)
    ck = checkpointer(engine, "memory://mem-run/ckpt", events)
    steps(engine, 0, 2, ck, save_at=(2,), wait=True)
    saved = state(engine)
    want = steps(engine, 2, 3)
    ck.close()
    engine.grads.close()
    engine = build(rank, world, case)
    ck = checkpointer(engine, "memory://mem-run/ckpt", events, resume="auto")
    first = ck.resume()
    loaded = state(engine)
    got = steps(engine, first, first + 1)
    ck.close()
    return {"saved": saved, "loaded": loaded, "want": want, "got": got, "first": first,
            "events": events}


def _fsync_fails_for(fragment: str) -> None:
    """os.fsync raises EIO for files whose path contains ``fragment`` (a dying disk)."""
    import errno
    import os

    real = os.fsync

    def fsync(fd: int) -> None:
        if fragment in os.readlink(f"/proc/self/fd/{fd}"):
            raise OSError(errno.EIO, "Input/output error (injected at fsync)")
        real(fd)

    os.fsync = fsync


def fsync_fails(rank: int, world: int, root: str, case: dict) -> dict:
    """Save after steps 2 and 3; rank 1's fsync of its step-3 shard fails with EIO."""
    from mscale.ckpt import catalog

    events: list = []
    engine = build(rank, world, case)
    if rank == 1:
        _fsync_fails_for("step-000003/rank-")
    ck = checkpointer(engine, f"{root}/ckpt", events)
    steps(engine, 0, 3, ck, save_at=(2, 3), wait=True)
    ck.close()
    engine.grads.close()
    return {"events": events, "latest": catalog.read_latest(f"{root}/ckpt"),
            "dirs": [e.name for e in catalog.entries(f"{root}/ckpt")]}


def commit_never_reached(rank: int, world: int, root: str, case: dict, timeout_s: float) -> dict:
    """Both ranks start a save; rank 1 then never reaches the commit. Rank 0's wait for it must
    fail after the job's timeout (the engine's options), not gloo's default 30 minutes. Rank 1
    stays alive (so that rank 0 sees a silent peer, not a closed connection) until rank 0 has
    its answer."""
    import os
    import time

    events: list = []
    engine = build(rank, world, case)
    engine.options.timeout_s = timeout_s  # what `mscale train --timeout` sets
    ck = checkpointer(engine, f"{root}/ckpt", events)
    steps(engine, 0, 1, ck, save_at=(1,))
    done = os.path.join(root, "rank0-done")
    if rank == 1:
        deadline = time.monotonic() + 600
        while not os.path.exists(done) and time.monotonic() < deadline:
            time.sleep(0.05)
        return {}
    t0 = time.monotonic()
    try:
        ck.wait()
        error = None
    except Exception as e:  # noqa: BLE001 - the failure is the result
        error = f"{type(e).__name__}: {e}"
    elapsed = time.monotonic() - t0
    open(done, "w").close()
    return {"error": error, "elapsed": elapsed}


def slow_write_outlasts_the_timeout(rank: int, world: int, root: str, case: dict,
                                    timeout_s: float, slow_s: float) -> dict:
    """Rank 1's write takes ``slow_s`` (> the job's timeout: its node's mount is slow), rank 0's
    is quick; both then wait for the save (`Checkpointer.close`). Returns rank 0's events and
    whether the save was committed."""
    from mscale.ckpt import catalog
    from mscale.train.faults import CheckpointFaults

    events: list = []
    engine = build(rank, world, case)
    engine.options.timeout_s = timeout_s
    slow = CheckpointFaults(None, copy_delay_s=slow_s) if rank == 1 else None
    ck = checkpointer(engine, f"{root}/ckpt", events, hooks=slow)
    steps(engine, 0, 1, ck, save_at=(1,))
    ck.close()
    engine.grads.close()
    return {"events": events,
            "latest": catalog.read_latest(f"{root}/ckpt") if rank == 0 else None}


def layouts_agree(rank: int, world: int, cases: list[dict]) -> list[str | None]:
    """Per case: None when the layout derived from the plan alone (`for_plan`, what offline
    conversion writes) equals the live engine's (`from_live`: its parameters and its optimizer's
    pieces, i.e. the gradient buffer's real buckets and ZeRO shard), else the first difference."""
    from dataclasses import fields

    from mscale.ckpt.ownership import for_plan, from_live

    out = []
    for case in cases:
        engine = build(rank, world, case)
        live, offline = from_live(engine.live_rank()), for_plan(engine.plan, rank)
        diff = next((f"{case}: rank {rank} {f.name}: live {getattr(live, f.name)!r:.300} != "
                     f"plan {getattr(offline, f.name)!r:.300}"
                     for f in fields(live) if f.compare
                     and getattr(live, f.name) != getattr(offline, f.name)), None)
        out.append(diff)
        engine.grads.close()
    return out


def save_at_two(rank: int, world: int, root: str, case: dict) -> None:
    """Train two steps and save step 2 under ``root/ckpt``."""
    events: list = []
    engine = build(rank, world, case)
    ck = checkpointer(engine, f"{root}/ckpt", events)
    steps(engine, 0, 2, ck, save_at=(2,), wait=True)
    ck.close()
    engine.grads.close()


def resume_outcome(rank: int, world: int, path: str, case: dict) -> dict:
    """Resume ``case`` from ``path``: the step, or the error this rank stopped with."""
    from mscale.errors import MscaleError

    engine = build(rank, world, case)
    ck = checkpointer(engine, "memory://resume-outcome/ckpt", [], resume=path)
    try:
        return {"first": ck.resume()}
    except MscaleError as e:
        return {"code": e.code, "file": e.file, "message": e.message}
    finally:
        ck.close()
        engine.grads.close()
