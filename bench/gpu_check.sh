#!/usr/bin/env bash
# GPU checks, run ON the device machine (one H200) by a session lent one:
#   here:   bash scripts/gpu-wheels.sh
#   device: bash bench/gpu_check.sh            (writes $OUT/gpu-check.txt and metrics)
# 1. the engine on CUDA with the mixed cpu:gloo,cuda:nccl default group (world 1: one GPU cannot
#    host two NCCL ranks), bf16 autocast, a ~0.9B LLaMA-class model; 2. its MFU against the
#    989 TFLOP/s dense peak, median over steps 6..N.
set -euo pipefail
cd "$(dirname "$0")/.."
OUT=${OUT:-/tmp/gpu-check}
mkdir -p "$OUT"
python3 -m pip install -q --no-index --no-deps .whl/*.whl
python3 -m pip install -q --no-deps --no-build-isolation -e .
nvidia-smi --query-gpu=name,memory.total,driver_version --format=csv | tee "$OUT/gpu-check.txt"
python3 -c "import torch; print('torch', torch.__version__, 'cuda', torch.version.cuda)" | tee -a "$OUT/gpu-check.txt"
mscale train plans/gpu-1b-h200.yaml --local 1 --steps "${STEPS:-30}" --run-dir "$OUT/run" \
  --log-interval 5 2>&1 | tail -n 12 | tee -a "$OUT/gpu-check.txt"
python3 - "$OUT/run/metrics.jsonl" <<'PY' | tee -a "$OUT/gpu-check.txt"
import json, statistics, sys
recs = [json.loads(l) for l in open(sys.argv[1])][5:]
mfu = statistics.median(r["mfu"] for r in recs)
tps = statistics.median(r["tokens_per_s"] for r in recs)
print(f"steps {recs[0]['step']}..{recs[-1]['step']}: median MFU {mfu:.3f}, {tps:,.0f} tokens/s, "
      f"loss {recs[0]['loss']:.3f} -> {recs[-1]['loss']:.3f}")
PY
