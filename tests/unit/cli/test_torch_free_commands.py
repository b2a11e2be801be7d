"""The commands that read a run directory and do no tensor work (`ckpt verify`, `ckpt ls`,
`recover`'s diagnosis, `watch`) never import torch: it cost ~1.1 s of recover's 2 s before its
checkpoint checks stopped importing it (ckpt/format.py, ckpt/slices.py). An operator runs them
in loops and on login nodes; the launchers have the same rule (train/test_launcher_imports.py)."""

from __future__ import annotations

import subprocess
import sys

from tests.conftest import REPO
from tests.unit.ckpt.helpers import global_state, plan, write_synthetic

COMMANDS = """
import sys
from mscale.cli.main import run
import mscale.recover.decide, mscale.recover.stages, mscale.watch.judge  # recover, watch
run_dir, ckpt = sys.argv[1], sys.argv[2]
for args in (["ckpt", "verify", ckpt], ["ckpt", "verify", "--quick", ckpt],
             ["ckpt", "ls", run_dir]):
    assert run(args) == 0, args
loaded = sorted(m for m in sys.modules if m == "torch" or m.startswith("torch."))
print("torch modules:", loaded[:5])
sys.exit(1 if loaded else 0)
"""


def test_the_read_only_commands_do_not_import_torch(tmp_path):
    p = plan(tp=2, dp=2)
    write_synthetic(str(tmp_path / "ckpt" / "step-000005"), p, global_state(p))
    proc = subprocess.run([sys.executable, "-c", COMMANDS, str(tmp_path),
                           str(tmp_path / "ckpt" / "step-000005")], cwd=REPO,
                          capture_output=True, text=True, timeout=120)
    assert proc.returncode == 0, proc.stdout + proc.stderr
