"""What watch does about a finding: record it, ask the job to act, keep a sick node out.

Every finding becomes one line of ``events.jsonl`` (source ``watch``) carrying its evidence, so
`recover`, dashboards and a post-mortem read the same facts the operator saw. The job is steered
only through the run directory, never by signals: ``control/checkpoint`` and ``control/halt`` are
read by the job's rank 0 at a step boundary (train/control.py).

A hardware straggler (slow device, node or link) is the one finding that excludes a machine, and
the order matters: first ``control/checkpoint``, then wait until the job's own ``checkpoint``
event shows a save committed at or after the request, and only then add the node to
``quarantine.json``. Replacing the node restarts the job from its newest checkpoint; a fresh one
means the replacement loses no progress (the rule of ByteDance's straggler study, OSDI 2025).
The wait is bounded: a job that cannot checkpoint is no reason to keep a bad node in the pool,
so past the bound the node is quarantined with ``checkpoint_confirmed: false`` in its evidence.
Imbalance causes (stage, data) are advice only and never quarantine a healthy node.

NaN/Inf asks the job to halt; a divergence names the newest committed checkpoint before the
first bad step to roll back to, and pins it (ckpt/pins.py) so that the job's retention keeps it
until recover has used it. With ``--no-act`` nothing here writes anything.
"""

from __future__ import annotations

import json
import time
from dataclasses import dataclass, field
from typing import Any, Callable, get_args

import numpy as np
from pydantic import ValidationError

from mscale.ckpt import catalog, pins
from mscale.config.records import Event, EventKind, Quarantine, QuarantineEntry
from mscale.errors import MscaleError
from mscale.runs.atomic import fs_and_path, write_json_atomic
from mscale.runs.rundir import RunDir
from mscale.watch.findings import Finding

_EVENT_KINDS = frozenset(get_args(EventKind))
UNNAMED_ACTION = ("none: the node names are placeholders of the flags' layout, not the "
                  "cluster's; give --hostlist (or watch the run with its plan) to quarantine")


@dataclass
class ActionConfig:
    """How far watch may act on what it finds."""

    act: bool = True
    """False (``--no-act``): observe only; nothing is written into the run directory."""
    ckpt_wait_s: float = 300.0
    """Longest wait for the job to commit the requested checkpoint before quarantining anyway.
    A save of a large model to a parallel filesystem takes minutes (MegaScale: tens of seconds
    to minutes); a job that cannot save within five is itself failing."""
    quarantine_s: float | None = 24 * 3600.0
    """How long a quarantined node stays out (None: until a human clears it). A day covers a
    repair or a burn-in; a node that was only briefly hot comes back on its own."""


def plain(value: Any) -> Any:
    """``value`` with numpy scalars and arrays turned into JSON types (evidence from detectors)."""
    if isinstance(value, dict):
        return {str(k): plain(v) for k, v in value.items()}
    if isinstance(value, (list, tuple)):
        return [plain(v) for v in value]
    if isinstance(value, np.ndarray):
        return plain(value.tolist())
    if isinstance(value, np.generic):
        return value.item()
    return value


def finding_dict(f: Finding) -> dict:
    """A finding as the plain JSON document the sinks and events carry."""
    return plain({"kind": f.kind, "severity": f.severity, "cause": f.cause, "message": f.message,
                  "ranks": list(f.ranks), "nodes": list(f.nodes), "first_step": f.first_step,
                  "last_step": f.last_step, "slowdown_pct": f.slowdown_pct,
                  "advice": f.advice, "evidence": f.evidence})


def _key_list(f: Finding) -> list:
    return [f.kind, f.cause, list(f.ranks), list(f.nodes)]


@dataclass
class _Pending:
    """A hardware straggler whose checkpoint was requested; quarantine follows its commit."""

    finding: Finding
    requested_at: float
    deadline: float


@dataclass
class Actor:
    """Turns findings into events, control requests and quarantine entries (module docstring)."""

    run: RunDir | None
    """The run directory acted on; None for a metrics file alone (nothing to act on)."""
    config: ActionConfig = field(default_factory=ActionConfig)
    clock: Callable[[], float] = time.time
    log: list[dict] = field(default_factory=list)
    """Every action taken, in order, for ``--json`` and the report."""
    pending: list[_Pending] = field(default_factory=list)
    _seen: list[dict] = field(default_factory=list)

    @property
    def acting(self) -> bool:
        return self.config.act and self.run is not None

    def seed(self, events: list[dict]) -> None:
        """Remember the findings an earlier watch already recorded in ``events.jsonl``, so that a
        second ``watch --once`` over the same steps does not record them again."""
        self._seen += [{**e["evidence"], "severity": e.get("severity")} for e in events
                       if e.get("source") == "watch" and isinstance(e.get("evidence"), dict)
                       and "finding_key" in e["evidence"]]
        if self.acting:
            self._quarantine()  # an unreadable quarantine.json fails now, not mid-run

    def _recorded(self, f: Finding, severity: str | None = None, cleared: bool = False) -> bool:
        """Recorded before: same key, and its steps overlap this finding's (the same episode);
        with ``severity``, recorded at that severity (an escalation); with ``cleared``, its
        clearing recorded."""
        key = _key_list(f)
        lo, hi = f.first_step or 0, f.last_step or f.first_step or 0
        return any(ev.get("finding_key") == key and (ev.get("first_step") or 0) <= hi
                   and (ev.get("last_step") or ev.get("first_step") or 0) >= lo
                   and (severity is None or ev.get("severity") == severity)
                   and (not cleared or ev.get("cleared") is True)
                   for ev in self._seen)

    def _evidence(self, f: Finding) -> dict:
        return {**finding_dict(f)["evidence"], "cause": f.cause,
                "slowdown_pct": plain(f.slowdown_pct), "first_step": f.first_step,
                "last_step": f.last_step, "advice": f.advice, "finding_key": _key_list(f)}

    def handle(self, findings: list[Finding], job_alive: bool, nodes_named: bool = True) -> None:
        """Act on new findings, except those an earlier watch already recorded (they are still
        reported: only the run directory is spared a second copy). ``nodes_named``: False when
        the layout's node names are placeholders (`JobLayout.named`): no node is quarantined."""
        for f in [f for f in findings if not self._recorded(f)]:
            evidence = self._evidence(f)
            self._seen.append({**evidence, "severity": f.severity})
            if not self.acting:
                continue
            if f.hardware and f.nodes and not nodes_named:
                evidence["action"], then = UNNAMED_ACTION, None
            else:
                evidence["action"], then = self._steer(f, job_alive, evidence)
            self._event(f.kind, f.severity, f.last_step, f.ranks, f.nodes, f.message, evidence)
            if then is not None:  # after the finding's event, which explains it
                then()

    def escalate(self, findings: list[Finding]) -> None:
        """Open findings whose severity rose (judge.py): one more event each, at the new
        severity, so that the record says what the operator was told. What was done about the
        finding when it opened stands: a hardware straggler is already on its way out."""
        for f in [f for f in findings if not self._recorded(f, f.severity)]:
            evidence = self._evidence(f)
            self._seen.append({**evidence, "severity": f.severity})
            if self.acting:
                self._event(f.kind, f.severity, f.last_step, f.ranks, f.nodes,
                            f"escalated to {f.severity}: {f.message}",
                            {**evidence, "action": "none: escalation of an open finding"})

    def clear(self, findings: list[Finding]) -> None:
        """Recorded findings that closed (judge.py): one ``info`` event each, ``cleared`` in its
        evidence, so that the record says the condition is gone (recover names only a slow link
        still open). Written as ``info``, not the finding's kind: no reader takes it for one."""
        for f in [f for f in findings
                  if self._recorded(f) and not self._recorded(f, cleared=True)]:
            evidence = {**self._evidence(f), "cleared": True, "finding": f.kind}
            self._seen.append({**evidence, "severity": "info"})
            if self.acting:
                self._event("info", "info", f.last_step, f.ranks, f.nodes,
                            f"cleared after step {f.last_step}: {f.message}",
                            {**evidence, "action": "none: the finding cleared"})

    def _steer(self, f: Finding, job_alive: bool,
               evidence: dict) -> tuple[str, Callable[[], None] | None]:
        """What a finding calls for: the words for its event, and the step to take after it."""
        if f.hardware and f.nodes:
            if job_alive:
                return ("checkpoint requested; the node is quarantined once it is committed",
                        lambda: self._request_checkpoint(f))
            return "quarantined at once: the job is not running", lambda: self._quarantine_now(
                f, None, "(the job is not running: its newest checkpoint holds all its progress)")
        if f.kind == "nan":
            if job_alive:
                return "halt requested", lambda: self._request("halt", f)
            return "none: the job is not running", None
        if f.kind == "divergence":
            target = self.rollback_target(f.first_step)
            evidence["rollback_to"] = target
            if target:
                evidence["pinned"] = self._pin(target, f)
            return (f"roll back to {target}" if target else
                    "no committed checkpoint precedes the divergence"), None
        return "recorded", None

    def _pin(self, target: str, f: Finding) -> bool | str:
        """Pin the rollback target so the job's retention cannot delete it before recover acts
        (ckpt/pins.py); True, or why it could not be pinned (the finding is still recorded)."""
        try:
            pins.pin(target, f"watch: the last checkpoint before the divergence from step "
                             f"{f.first_step}", "watch", now=self.clock())
        except (MscaleError, OSError) as e:
            return f"not pinned: {e}"
        return True

    def _request_checkpoint(self, f: Finding) -> None:
        now = self.clock()
        self._request("checkpoint", f)
        self.pending.append(_Pending(f, now, now + self.config.ckpt_wait_s))

    def observe(self, events: list[dict]) -> None:
        """New lines of ``events.jsonl``: a committed checkpoint at or after a request releases
        its quarantine."""
        for ev in events:
            if ev.get("kind") != "checkpoint" or ev.get("source") == "watch":
                continue
            t = float(ev.get("time") or 0)
            for p in [p for p in self.pending if t >= p.requested_at]:
                self.pending.remove(p)
                self._quarantine_now(p.finding, ev, "after the requested checkpoint was committed",
                                     job_running=True)

    def tick(self, job_alive: bool) -> None:
        """Past its bound, or once the job stopped, a pending quarantine goes ahead unconfirmed."""
        now = self.clock()
        for p in [p for p in self.pending if now >= p.deadline or not job_alive]:
            self.pending.remove(p)
            why = ("the job stopped before committing the requested checkpoint" if not job_alive
                   else f"no checkpoint committed within {self.config.ckpt_wait_s:.0f} s")
            self._quarantine_now(p.finding, None, f"unconfirmed: {why}", severity="warning",
                                 job_running=job_alive)

    def _request(self, name: str, f: Finding) -> None:
        body = {"source": "watch", "time": self.clock(), "finding": f.kind, "cause": f.cause,
                "ranks": plain(f.ranks), "nodes": list(f.nodes)}
        write_json_atomic(self.run.path("control", name), body)
        self.log.append({"action": f"control/{name}", "time": body["time"],
                         "finding_key": _key_list(f)})

    def rollback_target(self, first_bad_step: int | None) -> str | None:
        """The newest committed checkpoint strictly before ``first_bad_step`` (its path)."""
        if self.run is None:
            return None
        before = [e for e in catalog.entries(self.run.ckpt, sizes=False)
                  if e.committed and (first_bad_step is None or e.step < first_bad_step)]
        return catalog.join(self.run.ckpt, before[-1].name) if before else None

    def _quarantine(self) -> Quarantine:
        fs, path = fs_and_path(self.run.quarantine)
        try:
            raw = fs.cat_file(path)
        except FileNotFoundError:
            return Quarantine()
        try:
            return Quarantine.model_validate(json.loads(raw))
        except (ValueError, ValidationError) as e:
            raise MscaleError(f"unreadable quarantine file: {str(e).splitlines()[0]}",
                              file=self.run.quarantine,
                              fix="repair or remove it (preflight and recover read it too), "
                                  "or run watch with --no-act") from None

    def _quarantine_now(self, f: Finding, confirmed: dict | None, how: str,
                        severity: str = "info", job_running: bool = False) -> None:
        """Add ``f``'s nodes to quarantine.json (those not already in force) and record it.
        ``job_running``: the job goes on with the node (the console says how to stop it)."""
        now = self.clock()
        q = self._quarantine()
        held = {e.node for e in q.entries if e.expires is None or e.expires > now}
        expires = None if self.config.quarantine_s is None else now + self.config.quarantine_s
        evidence = {**plain(f.evidence), "finding": f.kind, "cause": f.cause,
                    "ranks": plain(f.ranks),
                    "steps": [f.first_step, f.last_step], "slowdown_pct": plain(f.slowdown_pct),
                    "checkpoint_confirmed": confirmed is not None,
                    "checkpoint": self._ckpt_path(confirmed),
                    "checkpoint_time": (confirmed or {}).get("time"),
                    "latest": self.rollback_target(None)}
        added = [n for n in f.nodes if n not in held]
        for node in added:
            q.entries.append(QuarantineEntry(node=node, since=now, expires=expires,
                                             reason=f"watch: {f.message}", evidence=evidence))
        if added:
            write_json_atomic(self.run.quarantine, q.model_dump(mode="json"))
        self.log.append({"action": "quarantine", "time": now, "nodes": added,
                         "already": sorted(set(f.nodes) - set(added)),
                         "checkpoint_confirmed": confirmed is not None, "how": how,
                         "job_running": job_running, "finding_key": _key_list(f)})
        self._event("info", severity, f.last_step, f.ranks,
                    f.nodes, f"quarantined {', '.join(f.nodes)} {how}",
                    {**evidence, "action": "quarantine", "added": added})

    def _ckpt_path(self, event: dict | None) -> str | None:
        step = (event or {}).get("step")
        return catalog.join(self.run.ckpt, catalog.step_dir(int(step))) if step else None

    def _event(self, kind: str, severity: str, step: int | None, ranks, nodes, message: str,
               evidence: dict) -> None:
        """One events.jsonl line; a finding kind the schema lacks is written as ``info`` with
        ``evidence.finding`` naming it."""
        evidence = {"finding": kind, **plain(evidence)}
        self.run.append_record(self.run.events, Event(
            source="watch", kind=kind if kind in _EVENT_KINDS else "info", severity=severity,
            step=step, ranks=plain(list(ranks)), nodes=list(nodes), message=message,
            evidence=evidence))
        self.log.append({"action": "event", "kind": kind, "severity": severity, "step": step,
                         "message": message})
