"""``mscale recover supervise -- CMD``: run a job, and bring it back each time it fails.

The loop: start CMD in its own process group (SIGINT/SIGTERM to supervise are passed on to it,
so the job halts at a step boundary and supervise stops with it); while it runs, run the watch
library in-process on its run directory (`mscale.watch.follow.Follower`, the same rules and
actions as ``mscale watch``). When the job exits non-zero, diagnose and decide
(`mscale.recover.decide.plan_recovery`, `apply_plan`), back off, and run the plan's command;
stop with the plan's exit code when it is unrecoverable, or 2 when the restart budget is spent.

A sick node found while the job runs is handled without losing a step. watch asks the job for a
checkpoint, waits for its commit, then quarantines the node (`mscale.watch.actions`); supervise
sees the new entry in ``quarantine.json`` and asks the job to halt at its next step boundary
(``control/halt``: the job saves, then exits 1), then recovers as from a failure: the plan
excludes the node, re-plans for the smaller world, and resumes from the halt's checkpoint.

Every phase of a recovery is timed into ``events.jsonl`` (`mscale.recover.phases`), and
``RUN/recover/supervise.json`` holds the state: restarts, their reasons and phase times.

Why a budget within a window and an exponential back-off: a job that fails again at once after
each restart (a bad input, a broken node not yet excluded) would otherwise restart forever and
hide the fault; a job that fails once a day should always come back. MegaScale restarts
automatically and reports >90% of faults repaired without a human; the remaining ones are the
repeated, unexplained failures the budget hands over.
"""

from __future__ import annotations

import json
import signal
import sys
import time
from dataclasses import dataclass, field
from typing import Callable

from mscale.config.records import Quarantine
from mscale.errors import (EXIT_BAD_INPUT, EXIT_CRITICAL, EXIT_INTERRUPTED, EXIT_WARNING,
                           MscaleError)
from mscale.recover.attempt_end import halted_on_request, reached_the_job
from mscale.recover.child import Child, contract_code
from mscale.recover.decision import RecoveryPlan
from mscale.recover.liveness import RunInUse, in_use_line, refuse_if_live, wait_until_free
from mscale.recover.phases import PhaseLog
from mscale.recover.command import option_value
from mscale.runs.atomic import fs_and_path, write_json_atomic
from mscale.runs.rundir import RunDir




@dataclass
class SuperviseOptions:
    """How hard supervise tries, and what it watches."""

    max_restarts: int = 5
    """Most restarts within ``window_s``; one more failure in the window ends supervision."""
    window_s: float = 3600.0
    """The sliding window of the budget: failures older than this are forgiven."""
    backoff_s: float = 10.0
    """Wait before the first restart in the window; doubled for each further one, up to
    ``max_backoff_s`` (a node or filesystem that just failed often needs a moment)."""
    max_backoff_s: float = 600.0
    """Cap of the back-off."""
    watch: bool = True
    """Run watch's rules in-process while the job runs (stragglers → checkpoint → exclude)."""
    watch_settings: dict = field(default_factory=dict)
    """WatchConfig fields to override (tests shorten warm-up and persistence)."""
    ckpt_wait_s: float = 300.0
    """Longest wait of watch for a requested checkpoint before it quarantines anyway."""
    interval_s: float = 0.5
    """Seconds between looks at the job, its records and quarantine.json."""
    allow_batch_change: bool = False
    """Passed to the re-planner: change the global batch when no layout keeps it."""


def find_run_dir(command: list[str]) -> str:
    """The ``--run-dir`` of a launch command (``--run-dir X`` or ``--run-dir=X``)."""
    value = option_value(command, "--run-dir")
    if value is not None:
        return value
    raise MscaleError("the command has no --run-dir", field="CMD",
                      fix="supervise a command that names its run directory, e.g. "
                          "`mscale recover supervise -- mscale train plan.yaml --local 8 "
                          "--run-dir runs/r1`, or give supervise --run-dir")


def backoff_for(opts: SuperviseOptions, recent: int) -> float:
    """Seconds to wait before a restart when ``recent`` restarts already happened in the window."""
    return min(opts.max_backoff_s, opts.backoff_s * (2 ** recent))


def quarantined(run: RunDir, now: float) -> dict[str, float]:
    """Nodes in force in ``quarantine.json`` → since when (unreadable or missing: none; watch
    and recover report a broken file, supervise only must not die of it)."""
    fs, path = fs_and_path(run.quarantine)
    try:
        q = Quarantine.model_validate_json(fs.cat_file(path))
    except Exception:  # noqa: BLE001 - see docstring
        return {}
    return {e.node: e.since for e in q.entries if e.expires is None or e.expires > now}


def job_nodes(run: RunDir) -> set[str] | None:
    """The nodes the job's latest attempt ran on, as its start event recorded them (under srun
    SLURM's names, which need not be the plan's; watch and an operator quarantine by those),
    else, before any start event, those of the plan it runs (``RUN/plan.yaml``). A plan name
    that is another node's SLURM name would otherwise halt the job for a node it never used.
    None when neither can be read."""
    from mscale.config.plan import load_plan
    from mscale.recover.relaunch import recorded_launch

    launch = recorded_launch(run)
    if launch and launch.nodes:
        return set(launch.nodes)
    try:
        return set(load_plan(run.plan).cluster.node_names())
    except Exception:  # noqa: BLE001 - unknown nodes: act on every new entry
        return None


def _say(line: str) -> None:
    print(f"recover supervise: {line}", file=sys.stderr, flush=True)


Planner = Callable[[str, list[str], SuperviseOptions], RecoveryPlan]


def default_planner(run_dir: str, command: list[str], opts: SuperviseOptions) -> RecoveryPlan:
    """`plan_recovery` then `apply_plan`: the plan, carried out."""
    from mscale.recover.decide import RecoverOptions, apply_plan, plan_recovery

    plan = plan_recovery(run_dir, RecoverOptions(execute=True, command=list(command),
                                                 allow_batch_change=opts.allow_batch_change))
    if plan.verdict != "unrecoverable":
        apply_plan(plan)
    return plan


@dataclass
class Supervisor:
    """State of one supervise session (module docstring)."""

    command: list[str]
    opts: SuperviseOptions = field(default_factory=SuperviseOptions)
    run_dir: str | None = None
    planner: Planner = default_planner
    clock: Callable[[], float] = time.time
    sleep: Callable[[float], None] = time.sleep
    restarts: list[float] = field(default_factory=list)
    """Wall times of the restarts made, oldest first."""
    log: list[dict] = field(default_factory=list)
    """One entry per attempt: its command, its exit code, the quarantine it was stopped for."""
    signalled: int | None = None
    child: Child | None = None
    exit_seen: float | None = None
    """When supervise saw the last attempt's exit: the end of a recovery's detect phase."""
    launched_wall: float = 0.0
    """Wall time of the last attempt's launch (records the job writes are dated by it)."""

    def __post_init__(self) -> None:
        self.run = RunDir(self.run_dir or find_run_dir(self.command))
        self.phases = PhaseLog(self.run, self.clock)

    def run_all(self) -> int:
        """Supervise until the job ends trained, stops on request, or cannot be recovered.
        A run directory a live job holds is refused before anything starts or is written
        (`recover.liveness.RunInUse`, exit 3): the job would only meet its lock."""
        refuse_if_live(self.run.root)
        old = {s: signal.signal(s, self._on_signal) for s in (signal.SIGINT, signal.SIGTERM)}
        try:
            return self._loop()
        finally:
            for s, h in old.items():
                signal.signal(s, h)

    def _on_signal(self, signum, frame) -> None:  # noqa: ARG002 - signal handler signature
        self.signalled = signum
        if self.child is not None:
            self.child.forward(signum)

    def _loop(self) -> int:
        command = list(self.command)
        while True:
            code, stopped_for, launched = self._attempt(command)
            code = contract_code(code)  # killed by SIGINT: 130, the job's own "interrupted"
            self.log.append({"command": command, "code": code, "stopped_for": stopped_for})
            if self.signalled is not None:
                _say(f"stopped by signal {signal.Signals(self.signalled).name}; "
                     f"the job exited {code}")
                # a signal's -N is no status; 130 is the job's own "interrupted"
                return code if 0 <= code <= 3 or code == EXIT_INTERRUPTED else EXIT_BAD_INPUT
            if code == 0:
                again = len(self.restarts)
                after = f" after {again} relaunch{'es' if again > 1 else ''}" if again else ""
                self._save_state("finished")
                _say(f"the job finished (exit 0){after}; {self.run.recover}/supervise.json "
                     "keeps the record")
                return 0
            if not reached_the_job(self.run, self.launched_wall):
                _say(f"the command exited {code} before the job started (nothing in "
                     f"{self.run.events} or the rank error files since the launch): its own "
                     "output above says why; not restarting")
                self._save_state("failed to start")
                return code if 0 < code <= EXIT_BAD_INPUT else EXIT_BAD_INPUT
            if code == EXIT_INTERRUPTED:  # somebody stopped it on purpose, not through us
                _say("the job was interrupted (a second Ctrl-C to it, or a stop before its "
                     "first step): not restarting")
                self._save_state("halted")
                return code
            if code == EXIT_WARNING and stopped_for is None and halted_on_request(
                    self.run, self.launched_wall):
                _say("the job halted on request (control/halt or a signal): not restarting")
                self._save_state("halted")
                return code
            next_command = self._recover(command, code, stopped_for, launched)
            if isinstance(next_command, int):
                return next_command
            command = next_command

    def _attempt(self, command: list[str]) -> tuple[int, tuple[float, str] | None, float]:
        """Run one attempt to its end: (exit code, the quarantine supervise stopped it for, its
        launch time)."""
        follower = self._follower()
        self.phases.mark("relaunched") if self.phases.current else self.phases.watch_attempt()
        before = quarantined(self.run, self.clock())
        launched, self.launched_wall = self.clock(), time.time()
        self.child, stopped_for = Child(command), None
        try:
            while (code := self.child.poll()) is None:
                follower = self._watch(follower)
                self.phases.poll()
                if stopped_for is None and self.signalled is None:
                    stopped_for = self._stop_if_quarantined(before)
                self.sleep(self.opts.interval_s)
            self.exit_seen = self.clock()
        finally:
            if self.child.poll() is None:  # supervise itself is failing: leave nothing behind
                self.child.proc.kill()
                self.child.proc.wait()
            self.child.reap_group()
        for _ in range(3):  # let watch read the stop and settle what it still waits for
            follower = self._watch(follower)
        self.phases.poll()
        if stopped_for is not None:
            self._clear_halt()
        return code, stopped_for, launched

    def _clear_halt(self) -> None:
        """Remove supervise's own halt request if the job ended without consuming it (it failed
        first): left there, it would stop the relaunched job at its first step."""
        fs, path = fs_and_path(self.run.path("control", "halt"))
        try:
            if fs.isfile(path) and json.loads(fs.cat_file(path)).get("source") == "recover":
                fs.rm(path)
        except (OSError, ValueError, AttributeError) as e:  # said: the relaunch would halt
            _say(f"could not remove supervise's halt request {path} ({type(e).__name__}: {e}); "
                 "the relaunched job halts at its first step unless it is removed")

    def _await_lock(self) -> None:
        """The job's launcher exited; its lock may outlive it a moment (a holder on this host
        not yet reaped) or, held from another host, until its lease runs out. Wait that long for
        it to go, so the diagnosis and the relaunch do not trip over the job's own lock; a lock
        still live after it is another job's: `RunInUse`, nothing written."""
        rec = wait_until_free(self.run.root, -1, clock=self.clock, sleep=self.sleep,
                              poll_s=self.opts.interval_s)
        if rec is not None:
            raise RunInUse(in_use_line(self.run.root, rec), code=EXIT_BAD_INPUT)

    def _stop_if_quarantined(self, before: dict[str, float]) -> tuple[float, str] | None:
        now = self.clock()
        new = {n: t for n, t in quarantined(self.run, now).items() if n not in before}
        ours = job_nodes(self.run) if new else None
        if ours is not None:  # a node another job or an operator set aside is not ours to act on
            new = {n: t for n, t in new.items() if n in ours}
        if not new:
            return None
        nodes = ", ".join(sorted(new))
        write_json_atomic(self.run.path("control", "halt"), {
            "source": "recover", "time": now, "reason": f"{nodes} quarantined"})
        _say(f"{nodes} quarantined while the job runs: asked it to halt at its next step "
             "boundary (a checkpoint is saved first), then it is relaunched without it")
        return min(new.values()), f"quarantine.json: {nodes}"

    def _recover(self, command: list[str], code: int, stopped_for: tuple[float, str] | None,
                 launched: float) -> list[str] | int:
        """Diagnose, decide and apply; the next command, or the exit code to stop with."""
        self._await_lock()
        rec = self.phases.failed(launched, at=stopped_for, known_at=self.exit_seen)
        took = rec.seconds("detect")
        if stopped_for:  # watch found the fault earlier: its finding says when, this the halt
            _say(f"{stopped_for[1]}; recovering (the job stopped {took:.1f} s after the "
                 "quarantine)")
        else:
            _say(f"the job exited {code}; recovering (detected in {took:.1f} s)")
        now = self.clock()
        recent = [t for t in self.restarts if now - t < self.opts.window_s]
        if len(recent) >= self.opts.max_restarts:
            _say(f"restart budget spent: {len(recent)} restarts in the last "
                 f"{self.opts.window_s:.0f} s (--max-restarts {self.opts.max_restarts}); "
                 "giving up")
            self._save_state("budget spent")
            return EXIT_CRITICAL
        try:
            plan = self.planner(self.run.root, command, self.opts)
        except RunInUse:  # another job took the run since: nothing of ours is written
            raise
        except MscaleError as e:
            _say(f"could not plan the recovery: {str(e).splitlines()[0]}")
            self._save_state("could not plan")
            raise
        self.phases.mark("diagnosed", plan_gist(plan))
        if plan.diagnosis.symptom == "finished":  # its last record: every step trained
            _say(f"the job exited {code} but the run finished every step: nothing to recover")
            self._save_state("finished", plan)
            return 0
        if plan.verdict == "unrecoverable" or not plan.command:
            reason = "; ".join(plan.reasons) or plan.diagnosis.summary or "no relaunch command"
            _say(f"unrecoverable: {reason}")
            self._save_state("unrecoverable", plan)
            return plan.exit_code if plan.verdict == "unrecoverable" else EXIT_CRITICAL
        wait = backoff_for(self.opts, len(recent))
        _say(f"{plan.diagnosis.summary} → {plan.verdict}; relaunching in {wait:.0f} s: "
             f"{' '.join(plan.command)}")
        rec.backoff_s = wait
        self.restarts.append(now)
        self._save_state("restarting", plan)
        self._backoff(wait)
        if self.signalled is not None:
            _say(f"stopped by signal {signal.Signals(self.signalled).name} before the restart")
            return EXIT_WARNING
        return list(plan.command)

    def _backoff(self, seconds: float) -> None:
        end = self.clock() + seconds
        while self.signalled is None and self.clock() < end:
            self.sleep(min(self.opts.interval_s, max(0.0, end - self.clock())))

    def _follower(self):
        if not self.opts.watch:
            return None
        from mscale.recover.supervise_watch import make_follower

        try:
            return make_follower(self.run, self.opts.watch_settings, self.opts.ckpt_wait_s)
        except MscaleError as e:
            _say(f"watch is off for this attempt: {str(e).splitlines()[0]}")
            return None

    def _watch(self, follower):
        """One watch pass; a watch that fails is turned off for the attempt, never the job."""
        if follower is None:
            return None
        try:
            follower.poll()
            return follower
        except Exception as e:  # noqa: BLE001 - see docstring
            _say(f"watch stopped for this attempt: {str(e).splitlines()[0]}")
            return None

    def _save_state(self, status: str, plan: RecoveryPlan | None = None) -> None:
        """``RUN/recover/supervise.json``: where supervision stands (a human reads it first)."""
        doc = {"status": status, "command": self.command, "restarts": self.restarts,
               "attempts": self.log, "recoveries": [r.summary() for r in self.phases.history],
               "last_plan": plan.to_json() if plan is not None else None}
        try:
            write_json_atomic(f"{self.run.recover}/supervise.json", doc)
        except Exception as e:  # noqa: BLE001 - the state file must not end supervision
            _say(f"could not write {self.run.recover}/supervise.json: {e}")


def plan_gist(plan: RecoveryPlan) -> dict:
    """What the diagnose event carries about the decision (the whole plan is recover's own
    decision document)."""
    return {"verdict": plan.verdict, "class": plan.diagnosis.cls,
            "symptom": plan.diagnosis.symptom, "checkpoint": plan.checkpoint.path,
            "checkpoint_step": plan.checkpoint.step, "exclude": plan.exclusions.nodes,
            "world": plan.replan.world if plan.replan else None, "command": plan.command}
