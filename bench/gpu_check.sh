#!/usr/bin/env bash
# GPU checks, run ON the device machine by a session lent one (one H200, the GPU the plans are
# written for; an H100 or H800 gets them retargeted, see gpu_plans.retarget; 4 GPUs add hier-dp):
#   here:   bash scripts/gpu-wheels.sh          (the wheels the GPU image lacks, into .whl/)
#           .venv/bin/python bench/gpu_check.py --rehearse   (the same checks on the CPU, first)
#   device: bash bench/gpu_check.sh             (run tool: carry [".whl"], timeout_s 600)
# Installs mscale there, then bench/gpu_check.py runs each check in its own process, most needed
# first, within BUDGET_S seconds (default 480): the 1B plan compiled (MFU, split, the planner's
# prediction), the ~3B plan, a plain compiled PyTorch loop of the 1B model (mscale / reference),
# no host sync in the micro-batches, the GPU checkpoint round trip, the 1B eager (compiled /
# eager, losses agree), SDPA's fused kernel, event timers, the flight recorder, torch's dump on
# an NCCL timeout (where it lands, what it names), hierarchical DP (4 GPUs).
# $OUT gets gpu-check.txt, gpu-ckpt-check.txt and each run's metrics (<gpu>_<what>_metrics.jsonl,
# e.g. h200_1b_compiled_metrics.jsonl: commit them under bench/data/); run directories stay in
# /tmp. Exit 1 if a check failed.
set -uo pipefail
cd "$(dirname "$0")/.."
OUT=${OUT:-/tmp/gpu-check}
mkdir -p "$OUT"
REPORT="$OUT/gpu-check.txt"
python3 -m pip install -q --no-index --no-deps --no-compile .whl/*.whl || exit 1
python3 -m pip install -q --no-deps --no-build-isolation --no-compile -e . || exit 1
nvidia-smi --query-gpu=name,memory.total,driver_version,clocks.max.sm --format=csv | tee "$REPORT"
python3 -c "import torch; print('torch', torch.__version__, 'cuda', torch.version.cuda)" \
  | tee -a "$REPORT"
PYTHONUNBUFFERED=1 python3 bench/gpu_check.py --out "$OUT" --work /tmp/gpu-check-work \
  --budget "${BUDGET_S:-480}"
