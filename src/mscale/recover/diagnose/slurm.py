"""SLURM's own output among a run's evidence: srun's task lines and slurmstepd's cancel lines.

A cancel line reads the same whether the operator ran ``scancel`` or srun tore a step down after
one task failed (``--kill-on-bad-exit``); `teardown` tells them apart by what precedes the
cancel, in the file and in the attempt's records, comparing slurmstepd's stamp (the node's local
time) with the records' Unix times through the offset from UTC the job recorded.
"""

from __future__ import annotations

import re
import time
from datetime import datetime, timedelta, timezone

from mscale.recover.diagnose.evidence import RunEvidence
from mscale.recover.diagnose.findings import Findings
from mscale.recover.diagnose.rules import FACT_RULES

_SRUN = re.compile(r"srun: error: (\S+): tasks? ([\d,\-]+): (.*)")
_CANCEL = re.compile(r"\*\*\*\s*(JOB|STEP)\s+(\S+)\s+ON\s+\S+\s+CANCELLED AT\s+(\S+)(.*?)\*\*\*",
                     re.IGNORECASE)
"""slurmstepd's ``*** STEP 25.0 ON node1 CANCELLED AT 2026-11-30T14:00:01 ***`` (or ``JOB 25``,
``… DUE TO TIME LIMIT ***``): the level, the job or step id, the time, what follows it."""
CANCEL_SLACK_S = 2.0
"""Seconds after a cancel's stamp (whole seconds, the node's local time) within which a record of
a failed rank still counts as written before the cancel."""


def slurm_output(f: Findings) -> set[int]:
    """SLURM output: the text rules, and srun's task lines (`_srun_line`). Returns the reading
    order (`Hit.seq`) of the cancel lines that follow one of srun's task-failure lines in their
    file. A task line after a cancel line is the teardown's consequence (the step's other tasks
    killed or terminated): it is kept as ``step_cancelled`` evidence, blaming nobody."""
    after_failure: set[int] = set()
    for info in f.ev.slurm:
        failed = cancelled = False
        for line in f.ev.lines(info):
            first = len(f.hits)
            f.text(info.source, line, None, info.mtime)
            for h in f.hits[first:]:
                if h.rule.key == "slurm_cancelled":
                    cancelled = True
                    if failed:
                        after_failure.add(h.seq)
            if m := _SRUN.search(line):
                if cancelled:
                    f.add("step_cancelled", info.source, line, None, info.mtime)
                else:
                    failed = _srun_line(f, info, line, m) or failed
    return after_failure


def _srun_line(f: Findings, info, line: str, m: re.Match) -> bool:
    """``srun: error: node3: task 5: Killed`` names the rank and its node; True when it says a
    task failed."""
    tasks, what = m.group(2), m.group(3)
    rank = int(re.split(r"[,\-]", tasks)[0])
    key = ("killed" if "Killed" in what or "signal" in what.lower()
           else "exit_nonzero" if "exit code" in what else None)
    if key:
        hit = f.add(key, info.source, line, rank, info.mtime)
        hit.evidence.node = m.group(1)
    return key is not None or "Out Of Memory" in what


def teardown(f: Findings, after_failure: set[int]) -> None:
    """A cancel line that is not the operator's scancel becomes the weak ``step_cancelled`` fact.
    With ``srun --kill-on-bad-exit`` (docs/recover.md) one task's failure makes srun cancel the
    step, and slurmstepd says ``*** STEP 25.0 ON node1 CANCELLED AT … ***`` as for a scancel.
    A STEP's cancel is the step torn down when a task failure precedes it in SLURM's output, or
    when the attempt records a failed rank no later than the cancel (an error
    file, the launcher's failed rank, train's own stop other than on a signal) or when SLURM
    cancelled its job DUE TO something (that line decides). A JOB's cancel without DUE TO stays
    the operator's scancel, whatever an earlier step's tasks did."""
    cancels = [h for h in f.hits if h.rule.key == "slurm_cancelled"]
    if not cancels:
        return
    due = {m.group(2).split(".")[0] for h in f.hits if h.rule.key.startswith("slurm_")
           and (m := _CANCEL.search(h.evidence.text)) and "DUE TO" in m.group(4).upper()}
    for h in cancels:
        m = _CANCEL.search(h.evidence.text)
        step = m is not None and m.group(1).upper() == "STEP"
        # a JOB's cancel is never the teardown: kill-on-bad-exit cancels the step, not the job
        # (with --open-mode=append an earlier step's failure may precede an operator's scancel)
        if step and (h.seq in after_failure or m.group(2).split(".")[0] in due
                     or _failed_before(f.ev, stamp(m.group(3), _utc_offset(f.ev)))):
            h.rule = FACT_RULES["step_cancelled"]


def stamp(text: str, utc_offset_s: int | None = None) -> float | None:
    """A slurmstepd time (``2026-11-30T14:00:01``, the node's local time) as Unix time; None if
    unreadable. ``utc_offset_s``: the node's offset from UTC, as the job recorded it; without
    it, this machine's local time (right when both share a time zone, as a cluster's usually
    do; a login node in another zone would shift every cancel by hours)."""
    try:
        when = datetime.strptime(text[:19], "%Y-%m-%dT%H:%M:%S")
        if utc_offset_s is None:
            return time.mktime(when.timetuple())
        return when.replace(tzinfo=timezone(timedelta(seconds=utc_offset_s))).timestamp()
    except (ValueError, OverflowError):
        return None


def _utc_offset(ev: RunEvidence) -> int | None:
    """The offset from UTC of the node that started the attempt (``start`` evidence ``launch``:
    train/session.py `launch_record`), when it was recorded."""
    value = ev.attempt.launch.get("utc_offset_s")
    return value if isinstance(value, int) and abs(value) <= 18 * 3600 else None


def _failed_before(ev: RunEvidence, at: float | None) -> bool:
    """Whether the attempt records a failed rank no later than ``at`` (+ `CANCEL_SLACK_S`): an
    error file, the launcher's first failed rank or hang, or train's own stop with an error
    or on request (a halt, a NaN; not a signal, which a scancel sends)."""
    def before(t: object) -> bool:
        return at is None or not isinstance(t, (int, float)) or t <= at + CANCEL_SLACK_S

    if any(before(rec.get("time")) for rec in ev.error_files.values() if isinstance(rec, dict)):
        return True
    if any(before(info.mtime) for info, _ in ev.elastic):
        return True
    for e in ev.attempt.events:
        evd = e.get("evidence") if isinstance(e.get("evidence"), dict) else {}
        if e.get("source", "train") != "train" or e.get("kind") not in ("stop", "hang") \
                or not before(e.get("time")):
            continue
        if "first_failed_rank" in evd or e.get("kind") == "hang":
            return True
        if evd.get("code") not in (0, None) and evd.get("reason") not in ("signal",
                                                                           "interrupted"):
            return True
    return False
