#!/usr/bin/env bash
# Run HERE before a device call: download the wheels the GPU image lacks (Python 3.12) into
# .whl/, which travels with the working tree (kept out of git by .git/info/exclude).
set -euo pipefail
cd "$(dirname "$0")/.."
grep -qx '/.whl/' .git/info/exclude 2>/dev/null || echo /.whl/ >> .git/info/exclude
mkdir -p .whl
python3 -m pip download -q --no-deps --only-binary=:all: --python-version 3.12 --implementation cp \
  --platform manylinux_2_28_x86_64 --platform manylinux_2_17_x86_64 --platform manylinux2014_x86_64 \
  --platform any -d .whl \
  "pydantic>=2.6" pydantic-core annotated-types typing-inspection "typer>=0.29" annotated-doc \
  zstandard isal
# python-hostlist publishes only a source archive; it is pure Python, so a wheel built here fits.
python3 -m pip wheel -q --no-deps -w .whl python-hostlist
ls .whl
