#!/usr/bin/env bash
# The whole test suite on a fresh machine: set up, then unit, distributed and end-to-end tests.
#
# In two phases, for the two cores this suite is sized for: first every test that judges no
# wall-clock behaviour, two pytest workers side by side (a test file stays on one worker, so its
# module fixtures are built once), filling the time one test's processes wait on each other;
# then the tests marked `timing` (a straggler, a slow link, preflight's verdict) and the SLURM
# ones, one at a time, with nothing of the suite beside them. With arguments, pytest runs them
# as given, in one process.
set -euo pipefail
cd "$(dirname "$0")/.."
bash scripts/setup.sh
# pytest rewrites every test module's asserts on import (~9 s of CPU for this suite) and keeps
# the result as bytecode unless PYTHONDONTWRITEBYTECODE is set (CI images often set it): then
# each of the three pytest processes below, and every test's worker that imports a test module,
# would redo it. __pycache__/ is ignored by git.
unset PYTHONDONTWRITEBYTECODE
pytest=(.venv/bin/python -m pytest -q -ra)
if [ $# -gt 0 ]; then
  exec "${pytest[@]}" --durations=25 "$@"
fi
status=0
echo "tests, phase 1 of 2: everything but the timing and SLURM tests, two workers"
"${pytest[@]}" --durations=15 -n 2 --dist loadscope -m "not timing and not slurm" || status=$?
echo "tests, phase 2 of 2: the timing and SLURM tests, one at a time"
"${pytest[@]}" --durations=15 -m "timing or slurm" || status=$?
exit "$status"
