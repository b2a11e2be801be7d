"""One process of a preflight job: join the job, measure on the plan's groups, send rank 0 the
figures; rank 0 judges and writes the report.

It runs exactly like train (srun, torchrun, or ``--local N``) and builds its groups with train's
`build_groups`, so it tests the links the job will use. Every collective has the job's timeout.
Each rank marks the phases it finished in the job's key-value store (`marks.py`); when a
collective fails (a dead or hung peer), rank 0 reads the marks and names the ranks, and their
nodes, that never finished the phase, instead of leaving a traceback.
"""

from __future__ import annotations

import os
import statistics
import sys
import time
from dataclasses import dataclass

import torch
import torch.distributed as dist

from mscale.config.plan import Plan
from mscale.config.preflight import CheckResult
from mscale.errors import EXIT_BAD_INPUT, MscaleError
from mscale.preflight import marks
from mscale.preflight.busbw import measure_groups
from mscale.preflight.compute import Slowdown, gemm_tflops
from mscale.preflight.options import PreflightOptions
from mscale.preflight.network import measure_pairs
from mscale.preflight.pace import Pace
from mscale.preflight.progress import TICKER, LinkProgress
from mscale.preflight.recheck import Suspects, suspects
from mscale.topology.env import LaunchEnv, check_node_matches, node_name
from mscale.topology.placement import placement_for

def check_world(plan: Plan, env: LaunchEnv, source: str | None) -> None:
    """The launcher must start exactly the plan's world: anything else tests other links."""
    world = plan.layout.world_size
    if env.world_size != world:
        raise MscaleError(f"the launcher started {env.world_size} processes ({env.launcher}) but "
                          f"the plan's layout needs {world}", file=source, field="layout",
                          fix=f"launch {world} processes (srun -n {world}, --local {world}, torchrun "
                              "--nnodes × --nproc-per-node), or "
                              "plan for the processes you have")


def _stored(phase: str, rank: int, payload: dict) -> None:
    """``phase`` finished and its figures are in the store: a failure before the next phase
    (the exchange with rank 0 after 'host') came after this phase's checks (`stop_record`)."""
    payload["stored"] = phase
    marks.mark(phase, rank, payload)


def stop_record(payload: dict, exc: BaseException) -> dict:
    """What one rank saw when its preflight stopped: the phase, how long into it, the error,
    and whether the phase's checks had finished with their figures stored (``finished``)."""
    since = payload.get("phase_t0")
    phase = payload.get("phase", "start")
    return {"phase": phase,
            "after_s": None if since is None else round(time.monotonic() - since, 2),
            "error": error_line(exc, 200), "finished": payload.get("stored") == phase}


def error_line(exc: BaseException, width: int = 300) -> str:
    """``Type: first line of the message`` (at most ``width`` characters of it): one error in
    one line of a report or of the console."""
    return f"{type(exc).__name__}: {(str(exc).strip().splitlines() or [''])[0][:width]}"


def _mark_failed(payload: dict, rank: int, exc: BaseException) -> None:
    """This rank saw its phase fail: it is alive, and not the one the others waited for. Its
    figures so far and what it saw go to rank 0 through the store (collectives may be broken)."""
    try:
        marks.mark_failed(payload, rank, stop_record(payload, exc))
    except Exception:  # noqa: BLE001 - the store lives in rank 0's process, which may be gone
        pass


def _clock_offsets(rounds: int = 5) -> list[float]:
    """Each rank's wall clock minus rank 0's, median over barrier-aligned samples."""
    world = dist.get_world_size()
    samples: list[list[float]] = [[] for _ in range(world)]
    for _ in range(rounds):
        dist.barrier()
        got: list = [None] * world
        dist.all_gather_object(got, time.time())
        for r, t in enumerate(got):
            samples[r].append(t - got[0])
    return [statistics.median(s) for s in samples]


PHASES = {"groups": "building the plan's TP/PP/DP groups",
          "compute": "GEMM throughput on every device",
          "p2p": "point-to-point bandwidth between the groups' neighbours",
          "collectives": "all-reduce / all-gather / reduce-scatter bus bandwidth per group",
          "host": "host checks (GPU health, ports, storage, environment)",
          "recheck": "measuring the suspects again (flagged only if slow twice)"}
"""The phases every rank goes through, in order, with what rank 0 tells the operator."""


def _phase(payload: dict, phase: str, rank: int, detail: str = "") -> None:
    """Enter ``phase``: where this rank is if a collective fails, and on rank 0 one progress
    line on stderr (stdout carries the report or the JSON document)."""
    payload["phase"] = phase
    payload["phase_t0"] = time.monotonic()  # how long into it a failure came (`stop_record`)
    if rank == 0:
        first_round = [p for p in PHASES if p != "recheck"]
        step = (f"{first_round.index(phase) + 1}/{len(first_round)}" if phase in first_round
                else phase)
        TICKER.line(f"preflight [{step}] {PHASES[phase]}{detail}")


def _progress(rank: int, label: str, noun: str) -> LinkProgress:
    """Where a link phase reports how far it is: rank 0's stderr, throttled (`progress.py`)."""
    return LinkProgress(label, noun, 0, TICKER if rank == 0 else None)


@dataclass
class Measuring:
    """What a rank measured with, kept for the second round."""

    device: torch.device
    groups: object
    slow: Slowdown
    pace: Pace
    """The links' figures so far, the same on every rank: a suspect measured again is
    compared with the first round's peers, and cut short as soon as it is far below them."""
    nodes: list[str]
    """Each rank's node (for rank 0's progress lines)."""


def measure(plan: Plan, opts: PreflightOptions, env: LaunchEnv, node: str,
            payload: dict) -> Measuring:
    """Every measurement of this rank, phase by phase, into ``payload`` (for rank 0); its
    ``phase`` says where this rank was if a collective fails."""
    from mscale.distributed.groups import build_groups
    from mscale.distributed.init import pick_device

    placement = placement_for(plan)
    timeout = _timeout(opts)
    slow = Slowdown(opts.inject_slow.get(env.rank, 1.0))
    payload.update(rank=env.rank, node=node, phase="start")
    device = pick_device(env)
    payload["device"] = device.type
    offsets = _clock_offsets()
    here: list = [None] * env.world_size  # this job's processes hold GPU memory: not leftovers
    dist.all_gather_object(here, (node, os.getpid()))
    pids = [pid for n, pid in here if n == node]
    nodes = [n for n, _ in here]
    pace = Pace()
    if env.rank == 0:  # before any phase can fail: the skew is reported with what was measured
        payload["clock_offsets"] = offsets
    _stored("start", env.rank, payload)
    _phase(payload, "groups", env.rank)
    groups = build_groups(placement, env.rank, timeout)
    marks.mark("groups", env.rank)
    _phase(payload, "compute", env.rank)
    tflops, n, dtype = gemm_tflops(device, opts.level, slow)
    payload["gemm"] = {"tflops": tflops, "n": n, "dtype": dtype}
    _stored("compute", env.rank, payload)
    from mscale.preflight.ib_ports import snapshot

    ib_before = snapshot(opts.sysfs_root) if env.local_rank == 0 else None
    _phase(payload, "p2p", env.rank)
    payload["pairs"] = measure_pairs(env.rank, placement, device, opts.level, slow, pace=pace,
                                     progress=_progress(env.rank, "p2p", "pairs"), nodes=nodes)
    _stored("p2p", env.rank, payload)
    _phase(payload, "collectives", env.rank)
    payload["groups"] = measure_groups(groups, device, opts.level, slow, pace=pace,
                                       progress=_progress(env.rank, "collectives", "groups"),
                                       nodes=nodes)
    _stored("collectives", env.rank, payload)
    _phase(payload, "host", env.rank)
    host = host_checks(plan, opts, env, node, ib_before, pids)
    payload["host"] = [r.model_dump(mode="json") for r in host]
    _stored("host", env.rank, payload)
    return Measuring(device, groups, slow, pace, nodes)


def measure_again(plan: Plan, opts: PreflightOptions, env: LaunchEnv, how: Measuring,
                  suspects: Suspects, payload: dict) -> dict:
    """The second round (`recheck.py`): only the suspects, the same way as the first time."""
    placement = placement_for(plan)
    again: dict = {"rank": env.rank}
    _phase(payload, "recheck", env.rank,
           f": {'every GEMM, ' if suspects.gemm else ''}{len(suspects.pairs)} pair(s), "
           f"{len(suspects.groups)} group(s)")
    if suspects.gemm:
        tflops, n, dtype = gemm_tflops(how.device, opts.level, how.slow)
        again["gemm"] = {"tflops": tflops, "n": n, "dtype": dtype}
    if suspects.pairs:
        again["pairs"] = measure_pairs(env.rank, placement, how.device, opts.level, how.slow,
                                       only=set(suspects.pairs), pace=how.pace,
                                       progress=_progress(env.rank, "recheck p2p", "pairs"),
                                       nodes=how.nodes)
    if suspects.groups:
        again["groups"] = measure_groups(how.groups, how.device, opts.level, how.slow,
                                         only=set(suspects.groups), pace=how.pace,
                                         progress=_progress(env.rank, "recheck collectives",
                                                            "groups"),
                                         nodes=how.nodes)
    marks.mark("recheck", env.rank)
    return again


def second_round(plan: Plan, opts: PreflightOptions, env: LaunchEnv, how: Measuring,
                 gathered: list | None, payload: dict) -> list | None:
    """Rank 0 names the suspects of the first round; every rank measures them again; rank 0
    gets the second figures (None when nothing was flagged)."""
    from mscale.preflight.report import judged_measurements

    box = [suspects(judged_measurements(plan, gathered)) if env.rank == 0 else None]
    dist.broadcast_object_list(box, src=0)
    if not box[0]:
        return None
    again = measure_again(plan, opts, env, how, box[0], payload)
    out: list | None = [None] * env.world_size if env.rank == 0 else None
    dist.gather_object(again, out, dst=0)
    return out


def host_checks(plan: Plan, opts: PreflightOptions, env: LaunchEnv, node: str, ib_before,
                pids: list[int]) -> list[CheckResult]:
    """The node's own checks (GPU health, IB ports, storage, environment), once per node, with
    the port counters' window opened before the network tests (``ib_before``)."""
    from mscale.preflight.host import node_checks

    if env.local_rank != 0:
        return []
    try:
        return node_checks(opts.run_dir, plan, level=opts.level, sysfs_root=opts.sysfs_root,
                           storage_url=opts.storage_url, node=node, ib_before=ib_before,
                           ignore_pids=pids, timeout_s=opts.timeout_s)
    except Exception as exc:  # noqa: BLE001 - one node's failure is its result, not the job's end
        return [CheckResult(check="host_checks", entity_kind="node", entity=node, node=node,
                            status="CRITICAL", expected="the node's checks run",
                            message=f"the node's own checks failed: {error_line(exc)}")]


def _timeout(opts: PreflightOptions):
    from datetime import timedelta

    return timedelta(seconds=opts.timeout_s)


def run_preflight_worker(plan: Plan, opts: PreflightOptions) -> None:
    """Run this rank's share and exit the process with the report's code (never returns).

    Under ``--local`` the launcher reads the report and chooses the exit code, so workers exit
    0 once it is written (a worker's 3 would read to the launcher as a crash)."""
    from mscale.distributed.init import init_distributed, shutdown_and_exit
    from mscale.preflight.report import assemble, publish
    from mscale.preflight.stopped import failure_report
    from mscale.topology.env import read_launch_env

    env = read_launch_env(command="preflight", world=plan.layout.world_size)
    check_world(plan, env, opts.plan_path)
    check_node_matches(plan, env)  # where train would refuse: links other than the job's
    if "OMP_NUM_THREADS" not in os.environ:
        torch.set_num_threads(max(1, (os.cpu_count() or 1) // max(1, env.local_world_size)))
    init_distributed(env, opts.timeout_s)
    if env.rank == 0:  # inputs are checked: the run directory may be made (nodes' probes use ckpt/)
        from mscale.runs.rundir import RunDir

        RunDir(opts.run_dir).create()
    node = node_name(env, plan)  # the name it is excluded by (the plan's under --local)
    marks.register(env.rank, node)
    local = env.launcher == "local"
    payload: dict = {"phase": "start", "phase_t0": time.monotonic()}
    try:
        how = measure(plan, opts, env, node, payload)
        gathered: list | None = [None] * env.world_size if env.rank == 0 else None
        dist.gather_object(payload, gathered, dst=0)
        again = second_round(plan, opts, env, how, gathered, payload)
    except Exception as exc:  # noqa: BLE001 - a dead/hung peer or a broken device: say which
        code = EXIT_BAD_INPUT
        if env.rank != 0:
            _mark_failed(payload, env.rank, exc)
        else:
            stopped = _when_stopped(env.world_size, payload, exc)
            code = publish(failure_report(plan, opts, *stopped), opts, quiet=local)
        sys.stderr.write(f"preflight: rank {env.rank} on {node}: {error_line(exc)}\n")
        # under --local every rank exits 0 so that the launcher lets rank 0 finish the report
        shutdown_and_exit(0 if local else code, barrier=False)
        return
    code = 0
    if env.rank == 0:
        code = publish(assemble(plan, opts, gathered, again), opts, quiet=local)
    codes = [code]
    dist.broadcast_object_list(codes, src=0)
    shutdown_and_exit(0 if local else codes[0])


STOP_GRACE_S = 10.0
"""How long rank 0 waits, after its own collective failed, for the other ranks to say they saw
a failure too. Not the timeout's length: with ``--timeout 1`` a healthy peer whose own wait
began a moment later was named dead; a rank that answers within it is alive."""


def _when_stopped(world: int, payload: dict, exc: BaseException):
    """Rank 0, after a collective failed: every rank's figures so far, what each rank that
    answered saw (rank → `stop_record`), the ranks that never answered, and rank → node; all
    from one reading of the store's lists (`marks.answers`), so no rank is both."""
    stops = {0: stop_record(payload, exc)}
    try:
        seen = marks.answers(stops[0]["phase"], world, STOP_GRACE_S)
    except Exception:  # noqa: BLE001 - the store may be gone with the peers
        return [payload], stops, [], lambda r: None
    payloads = marks.records("payload", sorted(r for r in seen.measured if 0 < r < world))
    stops.update(marks.records("failed", sorted(r for r in seen.failed if 0 < r < world)))
    return [payload, *payloads.values()], stops, seen.lost(world), seen.nodes.get
