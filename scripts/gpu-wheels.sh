#!/usr/bin/env bash
# Run HERE before a device call: download the wheels the GPU image lacks (Python 3.12) into
# .whl/, which travels with the working tree (kept out of git by .git/info/exclude).
set -euo pipefail
cd "$(dirname "$0")/.."
grep -qx '/.whl/' .git/info/exclude 2>/dev/null || echo /.whl/ >> .git/info/exclude
rm -rf .whl && mkdir -p .whl  # two versions of one package side by side would fail the install
python3 -m pip download -q --no-deps --only-binary=:all: --python-version 3.12 --implementation cp \
  --platform manylinux_2_28_x86_64 --platform manylinux_2_17_x86_64 --platform manylinux2014_x86_64 \
  --platform any -d .whl \
  "pydantic>=2.6" pydantic-core annotated-types typing-inspection "typer>=0.29" annotated-doc \
  zstandard isal "tensorboardX>=2.6"
# Everything else pyproject.toml requires is in the image (its package list: the device tool's
# KINDS.md); bench/gpu_check.py names any requirement still missing there before its checks.
# python-hostlist publishes only a source archive; it is pure Python, so a wheel built here fits.
python3 -m pip wheel -q --no-deps -w .whl python-hostlist
ls .whl
