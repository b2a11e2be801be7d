#!/usr/bin/env bash
# The whole test suite on a fresh machine: set up, then unit, distributed and end-to-end tests.
set -euo pipefail
cd "$(dirname "$0")/.."
bash scripts/setup.sh
exec .venv/bin/python -m pytest -q -ra --durations=25 "$@"
