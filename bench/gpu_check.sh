#!/usr/bin/env bash
# GPU checks, run ON the device machine (one H200, or more) by a session lent one:
#   here:   bash scripts/gpu-wheels.sh
#   device: bash bench/gpu_check.sh            (writes $OUT/gpu-check.txt and metrics)
# 1. the engine on CUDA with the mixed cpu:gloo,cuda:nccl default group (world 1: one GPU cannot
#    host two NCCL ranks), bf16 autocast, a ~0.9B LLaMA-class model; its MFU against the
#    989 TFLOP/s dense peak, median over steps 6..N, and its per-step time split; with the
#    blocks compiled (training.compile's CUDA default); 1b: again eager, for the ratio;
#    1c: a plain PyTorch loop of the same model, compiled, fused AdamW (bench/reference_loop.py),
#    and mscale's tokens/s over its; 1d: SDPA's kernel is a fused one (flash/cuDNN), named from
#    the profiler (PASS/FAIL); 1e: the ~3B plan, compiled, its MFU.
# 2. event timers: StepTimer on CUDA against the wall clock around a step of known matmuls (the
#    split must match, and the host must leave each region before the device finishes it).
# 3. the loss stays on the device: no synchronizing CUDA call inside a step's micro-batches
#    (train.step.run_micro_batches under torch.cuda.set_sync_debug_mode), with a control that
#    the detector sees float(loss).
# 4. hierarchical DP reduction on NCCL, issued from one thread (needs 4 GPUs: 2 "nodes" x 2;
#    skipped with a message otherwise): equal to flat, same issue order on every rank.
# 5. checkpoints on the GPU (bench/gpu_ckpt_check.py): the snapshot's copy ordered on the rank's
#    own device, a bit-exact save/load round trip, the async save's blocking ratio.
# Each of 1d and 2-5 prints PASS/FAIL/SKIP; the script exits 1 if any failed. ~7-8 min on one
# H200 (three 30-step runs of the 1B plan and a 20-step one of the 3B, three compiling first).
# Keep every run's metrics.jsonl as bench/data/h200_<what>_metrics.jsonl.
set -euo pipefail
cd "$(dirname "$0")/.."
OUT=${OUT:-/tmp/gpu-check}
mkdir -p "$OUT"
REPORT="$OUT/gpu-check.txt"
python3 -m pip install -q --no-index --no-deps .whl/*.whl
python3 -m pip install -q --no-deps --no-build-isolation -e .
nvidia-smi --query-gpu=name,memory.total,driver_version --format=csv | tee "$REPORT"
python3 -c "import torch; print('torch', torch.__version__, 'cuda', torch.version.cuda)" | tee -a "$REPORT"
mscale train plans/gpu-1b-h200.yaml --local 1 --steps "${STEPS:-30}" --run-dir "$OUT/run" \
  --log-interval 5 2>&1 | tail -n 12 | tee -a "$REPORT"
python3 - "$OUT/run/metrics.jsonl" <<'PY' | tee -a "$REPORT"
import json, statistics, sys
recs = [json.loads(l) for l in open(sys.argv[1])][5:]
mfu = statistics.median(r["mfu"] for r in recs)
tps = statistics.median(r["tokens_per_s"] for r in recs)
print(f"steps {recs[0]['step']}..{recs[-1]['step']}: median MFU {mfu:.3f}, {tps:,.0f} tokens/s, "
      f"loss {recs[0]['loss']:.3f} -> {recs[-1]['loss']:.3f}")
med = {k: statistics.median(r[k][0] for r in recs)
       for k in ("step_time", "compute_time", "comm_wait", "data_time", "bubble_time")}
print("median split (event timers), ms: " + ", ".join(f"{k} {v * 1e3:.1f}" for k, v in med.items()))
PY
echo "== 1b. the same run eager (training.compile: false): compiled / eager tokens/s" | tee -a "$REPORT"
python3 - "$OUT/plan-eager.yaml" <<'PY'
import sys, yaml
plan = yaml.safe_load(open("plans/gpu-1b-h200.yaml"))
plan["training"]["compile"] = False
yaml.safe_dump(plan, open(sys.argv[1], "w"))
PY
mscale train "$OUT/plan-eager.yaml" --local 1 --steps "${STEPS:-30}" --run-dir "$OUT/run-eager" \
  --log-interval 5 2>&1 | tail -n 3 | tee -a "$REPORT"
python3 - "$OUT/run/metrics.jsonl" "$OUT/run-eager/metrics.jsonl" <<'PY' | tee -a "$REPORT"
import json, statistics, sys
tps = [statistics.median(json.loads(l)["tokens_per_s"] for l in list(open(f))[5:]) for f in sys.argv[1:]]
print(f"compiled {tps[0]:,.0f} tokens/s, eager {tps[1]:,.0f}: ratio {tps[0] / tps[1]:.3f}")
PY
echo "== 1c. a plain PyTorch loop of the same model (torch.compile, fused AdamW): mscale / reference" | tee -a "$REPORT"
python3 bench/reference_loop.py plans/gpu-1b-h200.yaml --steps "${STEPS:-30}" > "$OUT/reference.json"
python3 - "$OUT/run/metrics.jsonl" "$OUT/reference.json" <<'PY' | tee -a "$REPORT"
import json, statistics, sys
ours = statistics.median(json.loads(l)["tokens_per_s"] for l in list(open(sys.argv[1]))[5:])
ref = json.loads(open(sys.argv[2]).read().strip().splitlines()[-1])
print(f"mscale {ours:,.0f} tokens/s, plain compiled PyTorch {ref['tokens_per_s']:,.0f}: "
      f"ratio {ours / ref['tokens_per_s']:.3f} (goal >= 1.0)")
PY
echo "== 1e. the ~3B plan (plans/gpu-3b-h200.yaml), compiled" | tee -a "$REPORT"
mscale train plans/gpu-3b-h200.yaml --local 1 --steps "${STEPS_3B:-20}" --run-dir "$OUT/run-3b" \
  --log-interval 5 2>&1 | tail -n 3 | tee -a "$REPORT"
python3 - "$OUT/run-3b/metrics.jsonl" <<'PY' | tee -a "$REPORT"
import json, statistics, sys
recs = [json.loads(l) for l in open(sys.argv[1])][5:]
print(f"3B: median MFU {statistics.median(r['mfu'] for r in recs):.3f}, median step "
      f"{statistics.median(r['step_time'][0] for r in recs):.3f} s (plan predicts 1.147 s)")
PY
failed=0
echo "== 1d. SDPA runs a fused attention kernel (flash or cuDNN), forward and backward" | tee -a "$REPORT"
python3 - <<'PY' 2>&1 | tee -a "$REPORT" || failed=1
import re, torch
from torch.profiler import ProfilerActivity, profile
from mscale.model.transformer import attention_core
# the 1B plan's attention: micro-batch 4, 16 query heads over 8 KV heads, 2048 tokens, d 128
q = torch.randn(4, 16, 2048, 128, device="cuda", dtype=torch.bfloat16, requires_grad=True)
k, v = (torch.randn(4, 8, 2048, 128, device="cuda", dtype=torch.bfloat16, requires_grad=True)
        for _ in range(2))
attention_core(q, k, v, None).sum().backward()  # warm-up
with profile(activities=[ProfilerActivity.CUDA]) as prof:
    attention_core(q, k, v, None).sum().backward()
    torch.cuda.synchronize()
names = sorted({e.name for e in prof.events() if e.device_type.name == "CUDA"})
fused = [n for n in names if re.search(r"flash|cudnn|fmha", n, re.IGNORECASE)]
print("attention kernels:", "; ".join(fused) or "none fused among: " + "; ".join(names[:12]))
print(("PASS" if fused else "FAIL") + ": SDPA used a fused (flash/cuDNN) kernel")
raise SystemExit(0 if fused else 1)
PY

echo "== 2. event timers against the wall clock" | tee -a "$REPORT"
python3 - <<'PY' 2>&1 | tee -a "$REPORT" || failed=1
import time, torch
from mscale.distributed.collectives import COMM_CLOCK
from mscale.train.timers import StepTimer

dev = torch.device("cuda", 0)
a = torch.randn(8192, 8192, device=dev, dtype=torch.bfloat16)
def work(n):
    for _ in range(n):
        a @ a
timer, rows = StepTimer(dev), []
for trial in range(4):
    torch.cuda.synchronize(dev)
    w0 = time.perf_counter()
    timer.start_step()
    work(20)                                   # compute
    with timer.region("data"):
        work(10)
    h0 = time.perf_counter()
    with timer.region("comm_wait"):
        with COMM_CLOCK.timed("tp"):           # nested: counted once, as comm_wait
            work(10)
    host_in_region = time.perf_counter() - h0
    out = timer.end_step()
    rows.append((time.perf_counter() - w0, host_in_region, out))
wall, host_in_region, out = rows[-1]
share = {k: out[k] / out["step"] for k in ("compute", "data", "comm_wait")}
print(f"wall {wall * 1e3:.2f} ms, events: " + ", ".join(f"{k} {v * 1e3:.2f}" for k, v in out.items())
      + f" ms; host time inside the comm region {host_in_region * 1e3:.3f} ms")
ok = (abs(out["step"] - wall) <= 0.05 * wall + 1e-3 and abs(share["compute"] - 0.5) < 0.1
      and abs(share["data"] - 0.25) < 0.05 and abs(share["comm_wait"] - 0.25) < 0.05
      and host_in_region < 0.2 * out["comm_wait"])
print(("PASS" if ok else "FAIL") + ": step = wall within 5%, split 50/25/25 within 5-10 points, "
      "host left the region before the device finished it (no per-region sync)")
raise SystemExit(0 if ok else 1)
PY

echo "== 3. the loss stays on the device until the step's gather" | tee -a "$REPORT"
python3 - <<'PY' 2>&1 | tee -a "$REPORT" || failed=1
import os, time, warnings
import torch, torch.distributed as dist
from mscale.topology.env import LaunchEnv
from mscale.train.engine import build_engine
from mscale.train.loop import train_step
from mscale.train.options import TrainOptions
from mscale.train.step import run_micro_batches
from mscale.train.timers import StepTimer
from tests.distributed.engine_cases import make_plan

dist.init_process_group("cpu:gloo,cuda:nccl", init_method="tcp://127.0.0.1:29533", rank=0,
                        world_size=1)
plan = make_plan(dict(mb=2, model=dict(layers=4, hidden=1024, heads=16, kv_heads=8,
                                       ffn_hidden=2816, vocab=32000, seq_len=1024),
                      training=dict(global_batch=16, precision="bf16", bucket_mb=25.0)))
env = LaunchEnv(0, 1, 0, 1, 0, "127.0.0.1", 29533, "bench", "localhost")
engine = build_engine(plan, env, TrainOptions(run_dir="memory://unused"))
engine.param_buffer.attach_modules(engine.chunks)
timer = StepTimer(engine.device)
for step in range(2):                          # warm-up: allocations, autotuning
    timer.start_step(); train_step(engine, step, timer); timer.end_step()
def caught(fn):
    with warnings.catch_warnings(record=True) as w:
        warnings.simplefilter("always")
        torch.cuda.set_sync_debug_mode("warn")
        try:
            value = fn()
        finally:
            torch.cuda.set_sync_debug_mode("default")
    return value, [str(x.message).splitlines()[0] for x in w if "synchroniz" in str(x.message)]
timer.start_step()
t0 = time.perf_counter()
loss, syncs = caught(lambda: run_micro_batches(engine, 2, timer))
host_s = time.perf_counter() - t0
_, control = caught(lambda: float(loss))       # the detector sees a real read
engine.grads.finish(); engine.optimizer.grad_norm(); engine.optimizer.step(1e-4)
dev_s = timer.end_step()["step"]
print(f"run_micro_batches: {len(syncs)} synchronizing calls {syncs[:3]}; host returned after "
      f"{host_s * 1e3:.1f} ms of a {dev_s * 1e3:.1f} ms step; control float(loss): "
      f"{len(control)} seen; loss {float(loss):.4f} ({loss.dtype}, {loss.device})")
ok = not syncs and control and loss.device.type == "cuda"
print(("PASS" if ok else "FAIL") + ": no host sync inside the micro-batches, the loss a device tensor")
dist.destroy_process_group()
raise SystemExit(0 if ok else 1)
PY

echo "== 4. hierarchical DP reduction on NCCL, issued from one thread" | tee -a "$REPORT"
NGPU=$(python3 -c "import torch; print(torch.cuda.device_count())")
if [ "$NGPU" -lt 4 ]; then
  echo "SKIP: hierarchical DP needs 4 GPUs (2 nodes x 2 per node), this machine has $NGPU" \
    | tee -a "$REPORT"
else
TMPD=$(mktemp -d)
cat > "$TMPD/hier_check.py" <<'PY'
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
PY
python3 "$TMPD/hier_check.py" 2>&1 | tee -a "$REPORT" || failed=1
fi
echo "== 5. checkpoints on the GPU: bit-exact save/load round trip, async blocking ratio" | tee -a "$REPORT"
python3 bench/gpu_ckpt_check.py 2>&1 | tee -a "$REPORT" || failed=1
echo "checks failed: $failed" | tee -a "$REPORT"
exit "$failed"
