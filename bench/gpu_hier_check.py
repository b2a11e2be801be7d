"""GPU check: hierarchical DP reduction on NCCL, issued from one thread (4 GPUs: 2 "nodes" x 2).

For every ZeRO stage, hierarchical (intra-node reduce-scatter, inter-node all-reduce, intra-node
all-gather) against flat: parameters after 4 steps equal within 1e-5, the collectives issued in
the same order on every rank, from the training thread (or autograd's, inside backward).
Run by bench/gpu_check.py (check hier-dp) when the machine has 4 GPUs.

    python3 bench/gpu_hier_check.py
"""
import os, sys, threading
sys.path.insert(0, os.getcwd())  # the repository root: tests.distributed.dp_model (spawned children too)
from datetime import timedelta
import torch, torch.distributed as dist, torch.multiprocessing as mp

def run(rank, q):
    from mscale.distributed.groups import build_groups
    from mscale.parallel.data import data_parallel
    from mscale.parallel.zero import DistributedOptimizer
    from mscale.topology.placement import Placement
    from tests.distributed.dp_model import batch, config, loss_fn, make_params, make_table
    dev = torch.device("cuda", rank); torch.cuda.set_device(dev)
    dist.init_process_group("cpu:gloo,cuda:nccl", init_method="tcp://127.0.0.1:29534",
                            rank=rank, world_size=4, timeout=timedelta(seconds=120))
    groups = build_groups(Placement(tp=1, pp=1, dp=4, gpus_per_node=2), rank,
                          timedelta(seconds=120), hierarchical_dp=True)
    res = {}
    for zero in (0, 1, 2):
        for hier in (False, True):
            params = [torch.nn.Parameter(p.detach().to(dev)) for p in make_params(0)]
            grads, pbuf = data_parallel(params, make_table(), groups, zero_stage=zero, bucket_bytes=400,
                               hierarchical=hier)
            if hier:
                grads.comm.issued = []
            cfg = config()
            opt = DistributedOptimizer(params, make_table(), grads, pbuf, cfg, groups)
            for step in range(4):
                x, y = batch(step)
                x, y = x[rank * 4:(rank + 1) * 4].to(dev), y[rank * 4:(rank + 1) * 4].to(dev)
                with grads.no_sync():
                    (loss_fn(params, x[:2], y[:2]) / 2).backward()
                (loss_fn(params, x[2:], y[2:]) / 2).backward()
                grads.finish()
                opt.step(cfg.lr, clip_coef=opt.clip_coef(cfg.grad_clip))
            opt.wait_params()
            res[(zero, hier)] = [p.detach().cpu() for p in params]
            if hier:
                log = grads.comm.issued
                res[("order", zero)] = [(g, o) for g, o, _ in log]
                # backward hooks run on autograd's device thread while this one waits in
                # backward(): at most that one thread besides this one, never a worker of ours
                res[("threads", zero)] = len({t for _, _, t in log} - {threading.get_ident()}) <= 1
            grads.close()
    q.put((rank, res))
    dist.barrier(); dist.destroy_process_group()

if __name__ == "__main__":
    ctx = mp.get_context("spawn"); q = ctx.Queue()
    procs = [ctx.Process(target=run, args=(r, q)) for r in range(4)]
    for p in procs: p.start()
    out = dict(q.get(timeout=300) for _ in procs)
    for p in procs: p.join(60)
    ok = True
    for zero in (0, 1, 2):
        flat, hier = out[0][(zero, False)], out[0][(zero, True)]
        diff = max(float(((a - b).abs() / (b.abs() + 1e-3)).max()) for a, b in zip(hier, flat))
        same_order = all(out[r][("order", zero)] == out[0][("order", zero)] for r in out)
        one_thread = all(out[r][("threads", zero)] for r in out)
        replicas = all(torch.equal(a, b) for r in out for a, b in zip(out[r][(zero, True)], hier))
        print(f"ZeRO {zero}: hierarchical vs flat max rel diff {diff:.2e}; "
              f"{len(out[0][('order', zero)])} collectives in the same order on every rank: "
              f"{same_order}; from the training thread (or autograd's, inside backward): {one_thread}; "
              f"replicas equal: {replicas}")
        ok = ok and diff < 1e-5 and same_order and one_thread and replicas
    print(("PASS" if ok else "FAIL") + ": hierarchical NCCL reduction from one thread")
    raise SystemExit(0 if ok else 1)
