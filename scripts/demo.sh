#!/usr/bin/env bash
# The main job on the embedded default, on a fresh machine: set up, then plan the bundled example.
set -euo pipefail
cd "$(dirname "$0")/.."
bash scripts/setup.sh
exec .venv/bin/mscale plan --cluster plans/clusters/a100-12288.yaml --model plans/models/gpt-175b.yaml \
  --training plans/training/gpt-175b.yaml "$@"
