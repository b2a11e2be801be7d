#!/usr/bin/env bash
# The main job on the embedded default, on a fresh machine: set up, then train the bundled tiny
# model on 8 gloo processes laid out tp 2 × pp 2 × dp 2. The run directory is left in runs/demo,
# or $MSCALE_RUN_DIR when set (as scripts/demo-text.sh). Extra arguments go to `mscale train`.
set -euo pipefail
cd "$(dirname "$0")/.."
bash scripts/setup.sh
exec .venv/bin/mscale train --local 8 --run-dir "${MSCALE_RUN_DIR:-runs/demo}" "$@"
