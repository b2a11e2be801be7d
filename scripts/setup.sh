#!/usr/bin/env bash
# Create .venv and install mscale with its test tools. Idempotent; safe to run on every call.
# The CPU path pins torch==2.13.0, a CPU build pip finds on local disk: an unpinned `torch`
# would pull a multi-GB CUDA build. On a GPU machine, install your CUDA torch first, then
# `pip install -e .` (the project itself only asks for torch>=2.4).
set -euo pipefail
cd "$(dirname "$0")/.."
PY=${PYTHON:-$(command -v python3.11 || command -v python3)}
if [ ! -x .venv/bin/python ]; then
  "$PY" -m venv .venv
fi
stamp=.venv/.mscale-installed
if [ ! -f "$stamp" ] || [ pyproject.toml -nt "$stamp" ]; then
  .venv/bin/pip install -q --disable-pip-version-check "torch==${MSCALE_TORCH:-2.13.0}"
  .venv/bin/pip install -q --disable-pip-version-check -e '.[test]'
  touch "$stamp"
fi
