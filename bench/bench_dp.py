"""Benchmark: mscale DP=2 ZeRO-1 against torch DDP (gloo), and bucket overlap on against off.

Prints ratios against references measured in the same run (not a test; no pass/fail):
- steps/s of mscale (GradBuffer + ParamGather + DistributedOptimizer, ZeRO-1, AdamW) / torch DDP + AdamW on
  the same model, data and bucket size (goal >= 1.0);
- exposed DP communication per step (seconds `GradBuffer.finish` blocks) with overlap / without
  (goal <= 1/3);
- mscale with the parameter all-gather left in flight for the next forward
  (``overlap_param_gather``, the default, forward hooks from `ParamGather.attach_modules`)
  against the blocking all-gather at the end of the step (the old behaviour).

Steps are timed back to back (one barrier before the timed steps, none between them): a barrier
between steps would wait for the all-gathers still in flight outside the timed region. The last
timed step includes `wait_params`.

On one 2-core machine over loopback gloo's communication burns the same cores as backward, so
overlap can hide little (docs/references.md). ``--netns`` (root only) runs each rank in its own network
namespace joined by a veth pair whose egress is rate-limited with ``tc tbf``: wire time is then
not CPU time, as on a real cluster. Only the private veth addresses below are used.

    .venv/bin/python bench/bench_dp.py                          # loopback
    sudo .venv/bin/python bench/bench_dp.py --netns --rate 1gbit
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import torch

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO))
NS = ("msbench0", "msbench1")
VETH = ("msb-veth0", "msb-veth1")
ADDR = ("10.231.77.1", "10.231.77.2")  # exist only inside the two namespaces


def build_model(args) -> torch.nn.Sequential:
    torch.manual_seed(0)
    layers = []
    for _ in range(args.layers):
        layers += [torch.nn.Linear(args.hidden, args.hidden), torch.nn.GELU()]
    return torch.nn.Sequential(*layers)


def param_table(model: torch.nn.Module):
    """The model's `ParamTable`, in `parameters()` order: no TP split; biases without decay."""
    from mscale.parallel.spec import ParamSpec, ParamTable

    return ParamTable(tuple(ParamSpec(name, tuple(p.shape), None, p.dim() > 1)
                            for name, p in model.named_parameters()))


def batches(args, rank: int):
    gen = torch.Generator().manual_seed(100 + rank)
    return [torch.randn(args.batch, args.hidden, generator=gen) for _ in range(4)]


def run_ddp(args, rank) -> dict:
    from torch.nn.parallel import DistributedDataParallel as DDP

    model = DDP(build_model(args), bucket_cap_mb=args.bucket_mb)
    opt = torch.optim.AdamW(model.parameters(), lr=1e-4)
    data = batches(args, rank)

    def step(i):
        model(data[i % 4]).square().mean().backward()
        opt.step()
        opt.zero_grad(set_to_none=True)

    return {"step_s": _time_steps(args, step)}


def run_mscale(args, rank, overlap: bool, param_gather: bool = True) -> dict:
    from mscale.config.training import TrainingConfig
    from mscale.parallel.data import data_parallel
    from mscale.parallel.zero import DistributedOptimizer

    groups = _groups()
    model = build_model(args)
    params = list(model.parameters())
    grads, pbuf = data_parallel(params, param_table(model), groups, zero_stage=1,
                       bucket_bytes=int(args.bucket_mb * 2**20),
                       overlap=overlap, overlap_param_gather=param_gather)
    pbuf.attach_modules([model])
    cfg = TrainingConfig(global_batch=2, lr=1e-4, beta2=0.999, weight_decay=0.01)
    opt = DistributedOptimizer(params, param_table(model), grads, pbuf, cfg, groups)
    data, exposed, gather, fwd_wait = batches(args, rank), [], [], []

    def step(i):
        w0 = pbuf.wait_s
        model(data[i % 4]).square().mean().backward()
        fwd_wait.append(pbuf.wait_s - w0)
        exposed.append(grads.finish())
        opt.grad_norm()
        gather.append(opt.step(cfg.lr))

    step_s = _time_steps(args, step, pbuf.wait)
    grads.close()
    n = args.steps
    return {"step_s": step_s, "exposed_s": statistics.median(exposed[-n:]),
            "gather_s": statistics.median(gather[-n:]),
            "forward_wait_s": statistics.median(fwd_wait[-n:]), "buckets": len(grads.layout.buckets)}


_GROUPS = {}


def _groups():
    """One DP group over the whole world, built once per process."""
    if "g" not in _GROUPS:
        from datetime import timedelta

        import torch.distributed as dist

        from mscale.distributed.groups import build_groups
        from mscale.topology.placement import Placement

        _GROUPS["g"] = build_groups(Placement(tp=1, pp=1, dp=dist.get_world_size(),
                                              gpus_per_node=1), dist.get_rank(),
                                    timedelta(seconds=120))
    return _GROUPS["g"]


def _time_steps(args, step, settle=None) -> float:
    """Median seconds per step over ``args.steps`` back-to-back steps after ``args.warmup``
    untimed ones; ``settle`` (waiting for work a step leaves in flight) ends the last one."""
    import torch.distributed as dist

    for i in range(args.warmup):
        step(i)
    if settle is not None:
        settle()
    dist.barrier()
    times, t0 = [], time.perf_counter()
    for i in range(args.warmup, args.warmup + args.steps):
        step(i)
        if settle is not None and i == args.warmup + args.steps - 1:
            settle()
        t1 = time.perf_counter()
        times.append(t1 - t0)
        t0 = t1
    return statistics.median(times)


def worker(rank: int, world: int, args) -> dict:
    """ABAB order over rounds so drift on the shared machine hits every variant alike."""
    torch.set_num_threads(1)
    out: dict[str, list[dict]] = {"ddp": [], "overlap": [], "no_overlap": [],
                                  "blocking_gather": []}
    for _ in range(args.rounds):
        out["ddp"].append(run_ddp(args, rank))
        out["overlap"].append(run_mscale(args, rank, overlap=True))
        out["blocking_gather"].append(run_mscale(args, rank, overlap=True, param_gather=False))
        out["no_overlap"].append(run_mscale(args, rank, overlap=False))
    return out


def _median(rows: list[dict], key: str) -> float:
    return statistics.median(r[key] for r in rows)


def report(results: list[dict], args) -> dict:
    r = results[0]
    nparams = sum(p.numel() for p in build_model(args).parameters())
    ddp, ov, no, blk = (_median(r[k], "step_s")
                        for k in ("ddp", "overlap", "no_overlap", "blocking_gather"))
    exp_ov, exp_no = _median(r["overlap"], "exposed_s"), _median(r["no_overlap"], "exposed_s")
    fig = {"params": nparams, "buckets": r["overlap"][0]["buckets"], "ddp_step_s": ddp,
           "mscale_step_s": ov, "mscale_no_overlap_step_s": no, "speed_vs_ddp": ddp / ov,
           "exposed_overlap_s": exp_ov, "exposed_no_overlap_s": exp_no,
           "exposed_ratio": exp_ov / exp_no if exp_no > 0 else float("nan"),
           "mscale_blocking_gather_step_s": blk, "speed_vs_ddp_blocking_gather": ddp / blk,
           "param_gather_s": _median(r["blocking_gather"], "gather_s"),
           "param_gather_forward_wait_s": _median(r["overlap"], "forward_wait_s"),
           "network": f"netns veth tbf {args.rate}" if args.netns else "loopback"}
    print(json.dumps(fig, indent=2))
    print(f"mscale ZeRO-1 vs DDP: {fig['speed_vs_ddp']:.2f}x steps/s (goal >= 1.0); with the "
          f"blocking parameter all-gather: {fig['speed_vs_ddp_blocking_gather']:.2f}x")
    print(f"exposed DP comm overlap/no-overlap: {exp_ov * 1e3:.1f} / {exp_no * 1e3:.1f} ms "
          f"= {fig['exposed_ratio']:.2f} (goal <= 0.33)")
    return fig


# ---------------------------------------------------------------------------------- netns
def _sh(*cmd: str) -> None:
    subprocess.run(cmd, check=True)


def netns_up(rate: str) -> None:
    netns_down()
    for ns in NS:
        _sh("ip", "netns", "add", ns)
    _sh("ip", "link", "add", VETH[0], "type", "veth", "peer", "name", VETH[1])
    for ns, veth, addr in zip(NS, VETH, ADDR):
        _sh("ip", "link", "set", veth, "netns", ns)
        _sh("ip", "-n", ns, "addr", "add", f"{addr}/30", "dev", veth)
        _sh("ip", "-n", ns, "link", "set", veth, "up")
        _sh("ip", "-n", ns, "link", "set", "lo", "up")
        _sh("tc", "-n", ns, "qdisc", "add", "dev", veth, "root", "tbf", "rate", rate,
            "burst", "256kb", "latency", "400ms")


def netns_down() -> None:
    for ns in NS:
        subprocess.run(["ip", "netns", "del", ns], stderr=subprocess.DEVNULL)


def run_netns(args) -> list[dict]:
    netns_up(args.rate)
    try:
        with tempfile.TemporaryDirectory() as tmp:
            procs = []
            for rank in (0, 1):
                env = dict(os.environ, GLOO_SOCKET_IFNAME=VETH[rank], OMP_NUM_THREADS="1")
                cmd = ["ip", "netns", "exec", NS[rank], sys.executable, __file__, "--worker",
                       str(rank), "--out", f"{tmp}/r{rank}.json"] + _forward(args)
                procs.append(subprocess.Popen(cmd, env=env))
            codes = [p.wait(timeout=1800) for p in procs]
            if any(codes):
                raise SystemExit(f"workers exited with {codes}")
            return [json.loads(Path(f"{tmp}/r{r}.json").read_text()) for r in (0, 1)]
    finally:
        netns_down()


def _forward(args) -> list[str]:
    return ["--hidden", str(args.hidden), "--layers", str(args.layers), "--batch",
            str(args.batch), "--bucket-mb", str(args.bucket_mb), "--steps", str(args.steps),
            "--warmup", str(args.warmup), "--rounds", str(args.rounds)]


def netns_worker(args) -> None:
    import torch.distributed as dist
    from datetime import timedelta

    rank = args.worker
    dist.init_process_group("gloo", init_method=f"tcp://{ADDR[0]}:29561", rank=rank,
                            world_size=2, timeout=timedelta(seconds=300))
    res = worker(rank, 2, args)
    Path(args.out).write_text(json.dumps(res))
    dist.barrier()
    dist.destroy_process_group()
    sys.stdout.flush()
    os._exit(0)


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--hidden", type=int, default=1024)
    p.add_argument("--layers", type=int, default=4)
    p.add_argument("--batch", type=int, default=128)
    p.add_argument("--bucket-mb", type=float, default=4.0)
    p.add_argument("--steps", type=int, default=10)
    p.add_argument("--warmup", type=int, default=3)
    p.add_argument("--rounds", type=int, default=2)
    p.add_argument("--netns", action="store_true", help="ranks in rate-limited netns (root)")
    p.add_argument("--rate", default="1gbit", help="tc tbf rate of each veth direction")
    p.add_argument("--worker", type=int, default=None, help=argparse.SUPPRESS)
    p.add_argument("--out", default=None, help=argparse.SUPPRESS)
    args = p.parse_args()
    if args.worker is not None:
        return netns_worker(args)
    if args.netns:
        results = run_netns(args)
    else:
        from mscale.distributed.spawn import run_distributed

        results = run_distributed(worker, 2, args, timeout_s=600)
    report(results, args)


if __name__ == "__main__":
    main()
