"""How the job's newest attempt ended, read from ``train``'s own ``stop``/``hang`` event.

The rules judge the metrics, and a job that dies writes no metrics about its death: a rank killed
at step 15 leaves fifteen healthy records and then nothing. What says it failed is the event the
launcher (``--local``: `train/job_watch.py`) or rank 0 (srun, torchrun: `train/failure.py`)
appends when the job ends, and rank 0's own ``stop`` at a finish or an agreed stop
(`train/loop.py`). This module reads that event into a `JobEnd` and, when the end was not a clean
finish, into one finding of kind ``stop``, so the verdict, the exit code, ``--json`` and a live
watch's last line all say that the job stopped and why.

What the event carries, by writer:

- rank 0 at a finish or an agreed stop: ``evidence.code`` (0 done, 1 halt or signal with a
  checkpoint saved, 2 NaN, 3 aborted: a full disk, rank 0 could not go on), ``evidence.reason``
  (``halt``, ``signal``, ``nan``, ``abort``) and ``detail``, ``step`` the last step completed;
- the ``--local`` launcher when a worker failed: severity ``critical``, no code (the job exits 3),
  ``evidence.first_failed_rank``, ``how`` (``killed by SIGKILL``, ``exited with code 3``),
  ``kind`` (the error file's class), and a ``hang`` event instead when ranks stopped answering;
- the ``--local`` launcher when the operator stopped the job before a checkpoint (a second
  Ctrl-C): severity ``warning``, ``evidence.reason`` ``interrupted``, code 130;
- rank 0 under srun or torchrun when it failed: severity ``critical``, its error line as the
  message, exit 3;
- watch itself (`liveness.py`, never written) when the job is gone without any of these:
  ``evidence.reason`` ``died``, no code.

Only the newest attempt counts: the caller passes the latest lifecycle event, so a crash that
``recover`` relaunched and whose relaunch finished is a finished job.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

from mscale.errors import EXIT_BAD_INPUT, EXIT_CRITICAL, EXIT_OK, EXIT_WARNING
from mscale.watch.findings import Finding

MAX_REASON = 300
"""Characters of the reason kept in the one line (an exception's text can be a paragraph; the
whole of it is in the event and the rank's error file)."""

_STOPPED = {
    "halt": "halt requested through control/halt",
    "signal": "a stop signal asked it to halt",
    "nan": "non-finite gradient norm",
    "abort": "aborted",
}
"""``evidence.reason`` of rank 0's own stop (train/loop.py) in words."""

_CAUSE = {"halt": "on_request", "signal": "on_request", "nan": "nan", "abort": "aborted",
          "interrupted": "interrupted", "died": "died"}

ADVICE = {
    "on_request": "a checkpoint was saved at the stop: the same `mscale train` command resumes "
                  "from it",
    "nan": "`mscale recover RUN` rolls back to a checkpoint before the bad step (the `nan` event "
           "in events.jsonl has the numbers)",
    "interrupted": "the operator stopped the job without a checkpoint: the same `mscale train` "
                   "command resumes from the last one",
    "aborted": "the reason says why (a full disk: free space); `mscale recover RUN` prints the "
               "relaunch from the newest checkpoint",
    "crashed": "`mscale recover RUN` names the cause from the logs, error files and events and "
               "prints the relaunch from the newest checkpoint",
    "hang": "`mscale recover RUN` names the hung rank and prints the relaunch from the newest "
            "checkpoint; py-spy dump of a hung rank shows where it waits",
    "died": "nothing recorded how it ended (the whole job killed, its node lost): "
            "`mscale recover RUN` reads the logs and error files and prints the relaunch from "
            "the newest checkpoint",
}


@dataclass(frozen=True)
class JobEnd:
    """The end of one attempt: how (``cause``), how bad, and the job's own exit code."""

    cause: str
    """``finished``, ``on_request`` (halt, signal), ``interrupted`` (by the operator, without a
    checkpoint), ``nan``, ``aborted``, ``crashed`` (a rank failed or was killed), ``hang``,
    ``died`` (gone without recording its end: inferred by `liveness`, no exit code seen)."""
    severity: str
    """``ok`` for a clean finish, else ``warning`` (a stop on request) or ``critical``."""
    reason: str
    """One line: what ended it, where."""
    exit_code: int | None
    """The job's exit code by train's contract (0 done, 1 stopped on request, 2 NaN, 3 failed,
    130 interrupted); None when the event does not say."""
    step: int | None = None
    ranks: list[int] = field(default_factory=list)
    nodes: list[str] = field(default_factory=list)
    run_id: str | None = None
    attempt: int | None = None
    event: dict[str, Any] = field(default_factory=dict)

    @property
    def abnormal(self) -> bool:
        return self.severity != "ok"

    def line(self) -> str:
        """``job stopped: rank 5 on node3 killed by SIGKILL (exit 3)``."""
        code = "" if self.exit_code is None else f" (exit {self.exit_code})"
        verb = "finished" if self.cause == "finished" else "stopped"
        return f"job {verb}: {self.reason}{code}"

    def as_dict(self) -> dict:
        """For ``--json``'s ``summary.job``."""
        return {"state": self.cause, "severity": self.severity, "exit_code": self.exit_code,
                "reason": self.reason, "step": self.step, "ranks": list(self.ranks),
                "nodes": list(self.nodes), "run_id": self.run_id, "attempt": self.attempt}

    def finding(self, last_step: int | None = None) -> Finding | None:
        """The finding of an abnormal end (None for a clean finish). ``last_step``: the newest
        step judged, when the event does not name one."""
        if not self.abnormal:
            return None
        step = self.step if self.step is not None else last_step
        return Finding(kind="stop", severity=self.severity, message=self.line(),
                       cause=self.cause, ranks=list(self.ranks), nodes=list(self.nodes),
                       first_step=None, last_step=step, advice=ADVICE.get(self.cause, ""),
                       evidence={"rule": "the job's own stop event (events.jsonl)",
                                 "exit_code": self.exit_code, "reason": self.reason,
                                 "run_id": self.run_id, "attempt": self.attempt,
                                 "event": self.event})


def job_end(event: dict, start: dict | None = None) -> JobEnd:
    """Read a ``stop`` or ``hang`` event of ``train`` (module docstring); ``start`` is the
    attempt's ``start`` event, for its attempt number and run id."""
    evidence = event.get("evidence") if isinstance(event.get("evidence"), dict) else {}
    started = (start or {}).get("evidence") if isinstance((start or {}).get("evidence"),
                                                          dict) else {}
    code = evidence.get("code")
    code = code if isinstance(code, int) and not isinstance(code, bool) else None
    severity = event.get("severity") or "info"
    why = evidence.get("reason")
    if event.get("kind") == "hang":
        cause, sev = "hang", "critical"
        code = EXIT_BAD_INPUT if code is None else code
    else:
        if code is None and severity == "critical" and why != "died":
            # the launcher's or a failed rank 0's stop: the job exits 3. A death watch inferred
            # (liveness.py) has no exit code anyone saw: a SIGKILLed launcher exits 137
            code = EXIT_BAD_INPUT
        if code == EXIT_OK or (code is None and severity not in ("warning", "critical")):
            cause, sev = "finished", "ok"
        elif why == "interrupted" or code == EXIT_WARNING or (code is None
                                                             and severity == "warning"):
            cause, sev = _CAUSE.get(why, "on_request"), "warning"
        else:
            cause = _CAUSE.get(why) or ("nan" if code == EXIT_CRITICAL else "crashed")
            sev = "critical"
    step = event.get("step")
    step = step if isinstance(step, int) and not isinstance(step, bool) else None
    return JobEnd(cause=cause, severity=sev, reason=_reason(event, evidence, why, step),
                  exit_code=code, step=step, ranks=_ints(event.get("ranks")),
                  nodes=[str(n) for n in event.get("nodes") or []],
                  run_id=evidence.get("run_id") or started.get("run_id"),
                  attempt=started.get("attempt") if isinstance(started.get("attempt"), int)
                  else None, event=event)


def _reason(event: dict, evidence: dict, why: str | None, step: int | None) -> str:
    message = " ".join(str(event.get("message") or "").split())
    if why in _STOPPED:  # rank 0's own stop: its reason, step and detail
        # the event's step is the last one completed; a NaN stops the step after it, before
        # its optimizer step (train/loop.py), and train's console names that step
        at = "" if step is None else (f" at step {step + 1}" if why == "nan"
                                      else f" after step {step}")
        text = _STOPPED[why] + at
        if why == "signal" and isinstance(evidence.get("signal"), str):
            text = text.replace("stop signal", f"stop signal ({evidence['signal']})", 1)
        detail = " ".join(str(evidence.get("detail") or "").split())
        if detail and why != "halt" and why != "signal":
            text += f": {detail}" if why == "abort" else f" ({detail})"
    elif message.startswith("failed: "):  # the --local launcher's line (train/job_watch.py)
        text = message.removeprefix("failed: ").removesuffix("; the other workers were stopped")
        how = evidence.get("how")
        if isinstance(how, str) and how:
            text = text.replace(f"{how} first", how, 1)
    else:  # e.g. a failed rank 0's error line; "stopped: ..." of a worker whose launcher died
        text = message.removeprefix("stopped: ") or f"{event.get('kind', 'stop')} event"
    return text if len(text) <= MAX_REASON else text[: MAX_REASON - 1] + "…"


def _ints(values) -> list[int]:
    return [int(v) for v in values or [] if isinstance(v, int) and not isinstance(v, bool)]


def checkpoint_failure(event: dict) -> Finding:
    """A ``checkpoint_failed`` event of train's (ckpt/checkpointer.py) as a warning finding: the
    job goes on (a full disk stops it, which its stop event says), but ``latest`` stays older
    than it should, and a storage that failed once fails again."""
    evidence = event.get("evidence") if isinstance(event.get("evidence"), dict) else {}
    step = event.get("step")
    step = step if isinstance(step, int) and not isinstance(step, bool) else None
    message = " ".join(str(event.get("message") or "a checkpoint failed").split())
    return Finding(kind="checkpoint", severity="warning", message=message[:MAX_REASON],
                   ranks=_ints(event.get("ranks")), first_step=step, last_step=step,
                   evidence={"rule": "the job's own checkpoint_failed event (events.jsonl)",
                             "latest": evidence.get("latest"), "path": evidence.get("path"),
                             "errors": evidence.get("errors") or evidence.get("error")},
                   advice="check the checkpoint storage (`mscale preflight` measures it); until "
                          "a save commits again, a failure loses every step since latest")

