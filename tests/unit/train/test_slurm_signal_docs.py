"""SLURM's time-limit warning as the docs tell users to ask for it (docs/slurm.md, "A time
limit: the warning signal").

Seen on the local SLURM: ``--signal=B:USR1@…``, which docs/train.md recommended, signals the
batch shell only; the training tasks never saw it, bash died of it and the job was torn down with
SIGTERM, its save limited to KillWait again. Without ``B:`` the tasks halt on SIGUSR1 with a
checkpoint, and the documented script requeues the job when its stop event names SIGUSR1: the
pattern it greps must match the line train writes, and only that line.
"""

from __future__ import annotations

import re

from mscale.config.records import Event
from tests.conftest import REPO
from tests.e2e import docs_cases as dc

SLURM_DOC = REPO / "docs" / "slurm.md"


def test_no_doc_or_docstring_sends_the_warning_to_the_batch_shell_only():
    files = [REPO / "README.md", *sorted((REPO / "docs").glob("*.md")),
             *sorted((REPO / "src" / "mscale").rglob("*.py"))]
    found = [f"{p.relative_to(REPO)}:{n}" for p in files
             for n, line in enumerate(p.read_text().splitlines(), 1)
             if re.search(r"--signal[= ]B:", line)]
    assert not found, found


def _time_limit_script() -> str:
    blocks = [b for b in dc.parse_markdown(SLURM_DOC.read_text(), "docs/slurm.md") if b.shell]
    scripts = ["\n".join(b.body) for b in blocks if "#SBATCH --signal=" in "\n".join(b.body)]
    assert len(scripts) == 1, scripts
    return scripts[0]


def _line(**fields) -> str:
    """An events.jsonl line as the run directory writes it (runs/rundir.py)."""
    return Event(**fields).model_dump_json(exclude_none=True)


def test_the_documented_requeue_matches_trains_stop_on_the_warning_only():
    script = _time_limit_script()
    assert re.search(r"#SBATCH --signal=USR1@\d+", script), script
    grep = re.search(r"grep -q '([^']+)'", script)
    assert grep and "scontrol requeue" in script, script
    pattern = re.compile(grep.group(1))  # a basic regex of quotes, letters and `.*`
    stop = {"source": "train", "kind": "stop", "severity": "warning", "step": 106,
            "message": "training process exited with code 1 (signal)"}
    evidence = {"code": 1, "reason": "signal", "last_checkpoint": "runs/r1/ckpt/step-000106"}
    assert pattern.search(_line(**stop, evidence={**evidence, "signal": "SIGUSR1"}))
    assert not pattern.search(_line(**stop, evidence={**evidence, "signal": "SIGTERM"}))
    assert not pattern.search(_line(**stop, evidence={**evidence, "reason": "halt"}))
    # the signal event train writes at the step boundary, before the save, is not the stop
    assert not pattern.search(_line(source="train", kind="signal", severity="warning", step=106,
                                    evidence={"signal": True}))
