"""SLURM's time-limit warning as the docs tell users to ask for it (docs/slurm.md, "A time
limit: the warning signal").

Seen on the local SLURM: ``--signal=B:USR1@…``, which docs/train.md recommended, signals the
batch shell only; the training tasks never saw it, bash died of it and the job was torn down with
SIGTERM, its save limited to KillWait again. Without ``B:`` the tasks halt on SIGUSR1 with a
checkpoint, and the documented script requeues the job when train's newest stop event names
SIGUSR1: its lines are run here on events.jsonl lines as train writes them. Not after a SIGTERM or
a halt, also when an earlier attempt stopped on the warning (a first version read the last 20
lines, and requeued after an operator's halt whose attempt had written few events).
"""

from __future__ import annotations

import re
import subprocess

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


def _stop(**evidence) -> str:
    return _line(source="train", kind="stop", severity="warning", step=106,
                 message="training process exited with code 1 (signal)",
                 evidence={"code": 1, "reason": "signal", **evidence})


def _requeues(tmp_path, script: str, events: list[str]) -> bool:
    """Run the script's lines from ``code=$?`` to ``fi`` after a train exit 1, on these
    events, with ``scontrol requeue`` replaced by a marker."""
    lines = script.splitlines()
    tail = lines[lines.index("code=$?"):]
    snippet = "\n".join(tail[:tail.index("fi") + 1])
    assert 'scontrol requeue "$SLURM_JOB_ID"' in snippet, snippet
    (tmp_path / "events.jsonl").write_text("".join(e + "\n" for e in events))
    bash = f"RUN={tmp_path}\n(exit 1)\n" + snippet.replace(
        'scontrol requeue "$SLURM_JOB_ID"', "echo REQUEUE")
    out = subprocess.run(["bash", "-c", bash], capture_output=True, text=True, timeout=30)
    assert out.returncode == 0, out.stderr
    return out.stdout.strip() == "REQUEUE"


def test_the_documented_script_requeues_after_trains_stop_on_the_warning_only(tmp_path):
    script = _time_limit_script()
    assert re.search(r"#SBATCH --signal=USR1@\d+", script), script
    usr1 = _stop(signal="SIGUSR1")
    # the signal event train writes at the step boundary, and the checkpoint, come before it
    before = [_line(source="train", kind="signal", severity="warning", step=106,
                    evidence={"signal": True}),
              _line(source="train", kind="checkpoint", step=106, message="committed")]
    assert _requeues(tmp_path, script, [*before, usr1])
    assert not _requeues(tmp_path, script, [*before, _stop(signal="SIGTERM")])
    # an earlier attempt stopped on the warning; this one on control/halt: an operator's stop
    halt = _stop(reason="halt")
    assert not _requeues(tmp_path, script, [usr1, _line(source="train", kind="start"), halt])
