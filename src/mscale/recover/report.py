"""The readable report of `mscale recover`: the verdict, the diagnosis with its evidence lines,
the checkpoint and those passed over, the exclusions, the re-plan with its cost, why, and the
relaunch command. Here rather than in the CLI so that the command only parses, calls and
prints, and the report's rules (how many evidence lines, how a long one is cut without losing
the ranks that also said it) live with the plan they describe (`decision.RecoveryPlan`);
``--json`` is `RecoveryPlan.to_json`."""

from __future__ import annotations

import shlex

from mscale.errors import EXIT_BAD_INPUT
from mscale.recover.decision import Diagnosis, Evidence, Exclusions, RecoveryPlan
from mscale.recover.diagnose.classify import SOURCE_LOCATION
from mscale.recover.relaunch import by_hand

EVIDENCE_LINES = 5
"""Evidence lines the report shows (most telling first); --json has them all."""
LINE_CHARS = 160
"""An evidence line is cut here in the report (a gloo error runs to 300 characters)."""
RANKS_NAMED = 8
"""Other ranks named on an evidence line many ranks wrote (the rest are counted)."""


def _step_time(rp) -> str:
    old, new = rp.old_step_time_s, rp.new_step_time_s
    if old is None or new is None:
        return "predicted step time unknown"
    pct = f" ({(new / old - 1) * 100:+.0f}%)" if old > 0 else ""
    return f"predicted step time {old:.3g} s -> {new:.3g} s{pct}"


def _evidence_line(ev: Evidence) -> str:
    """One evidence line cut to `LINE_CHARS`, keeping who else said it: the source location a
    C++ library prefixes (``[/__w/pytorch/…/pair.cc:553]``) goes first, it tells an operator
    nothing; the message is cut, never the ranks."""
    who = ", ".join(x for x in (f"rank {ev.rank}" if ev.rank is not None else "",
                                ev.node or "") if x)
    head = f"  {ev.source}" + (f" [{who}]" if who else "") + ": "
    tail = ""
    if ev.also_ranks:
        named = ",".join(map(str, ev.also_ranks[:RANKS_NAMED]))
        tail = f" [+{len(ev.also_ranks)} more rank(s): {named}" + \
            ("…]" if len(ev.also_ranks) > RANKS_NAMED else "]")
    text = SOURCE_LOCATION.sub("", ev.text)
    room = max(LINE_CHARS - len(head) - len(tail), 20)
    return head + (text if len(text) <= room else text[: room - 1] + "…") + tail


def _diagnosis_lines(d: Diagnosis) -> list[str]:
    out = [f"diagnosis: {d.cls} / {d.symptom} — {d.summary}"]
    out += [_evidence_line(ev) for ev in d.evidence[:EVIDENCE_LINES]]
    if len(d.evidence) > EVIDENCE_LINES:
        out.append(f"  … {len(d.evidence) - EVIDENCE_LINES} more evidence line(s) in --json")
    facts = []
    if d.suspect_ranks:
        facts.append("suspect ranks " + ",".join(map(str, d.suspect_ranks)))
    if d.suspect_nodes:
        facts.append("suspect nodes " + ",".join(d.suspect_nodes))
    for name, value in (("last step", d.failed_step), ("bad step", d.bad_step),
                        ("attempt", d.attempt), ("exit code", d.exit_code)):
        if value is not None:
            facts.append(f"{name} {value}")
    if d.transient:
        facts.append("likely transient")
    return out + ([f"  {'; '.join(facts)}"] if facts else [])


def _exclusion_lines(ex: Exclusions) -> list[str]:
    """This recovery's exclusions, then the nodes the job had already kept out that the
    relaunch cannot use either (the re-plan counts both), and those it lets back: an operator
    must tell a verdict of this failure from the job's own earlier choice."""
    mine = "none" if not ex.nodes else f"{len(ex.nodes)} node(s)"
    out = [f"exclusions: {mine}" + (" by this recovery" if ex.carried else "")]
    out += [f"  {n}: {ex.reasons.get(n, '')}" for n in ex.nodes]
    if ex.carried:
        out.append(f"kept out by the job already: {len(ex.carried)} node(s) the failed attempt "
                   "ran on")
        out += [f"  {n}: {why}" for n, why in ex.carried.items()]
    if ex.released:  # recorded: kept out again later, it was an operator's doing
        out.append(f"let back by this recovery: {', '.join(ex.released)} (kept out by the job "
                   "for quarantine, which no longer holds it)")
    return out


def _decision_lines(plan: RecoveryPlan) -> list[str]:
    c, ex, rp = plan.checkpoint, plan.exclusions, plan.replan
    out = [f"checkpoint: {c.path} (step {c.step}) — {c.reason}" if c.path else
           f"checkpoint: none — {c.reason}"]
    out += [f"  passed over {r.get('name')}: {r.get('why')}" for r in c.rejected]
    out += _exclusion_lines(ex)
    if rp is not None:
        out.append(f"re-plan: {rp.old_layout} -> {rp.layout}, {rp.world} ranks on "
                   f"{len(rp.nodes)} node(s)" + (f", plan {rp.plan_path}" if rp.plan_path else ""))
        batch = "changed" if rp.batch_changed else "kept"
        cost = rp.note if "step time" in rp.note else "; ".join(
            x for x in (_step_time(rp), rp.note) if x)  # the re-plan's note, else ours
        out.append(f"  {cost}; global batch {rp.global_batch} {batch}")
        if rp.unused_nodes:
            out.append(f"  left idle: {', '.join(rp.unused_nodes)}")
    if plan.data_skip:
        s = plan.data_skip
        out.append(f"data skip: {s.get('skip_steps')} step(s) after step {s.get('after_step')}"
                   + (f" — {s['reason']}" if s.get("reason") else ""))
    return out


BY_HAND = "recover has no launch command to run"
NEXT_BY_HAND = ("start the job again yourself with its own command (it resumes as said above), "
                "or run it under `mscale recover supervise -- CMD`")
"""What the operator does next when `by_hand`: the dry run's closing line and --execute's line
on stderr."""


def exit_code(plan: RecoveryPlan, executed: bool) -> int:
    """What ``recover`` exits with, as far as it is known before any launch: the verdict's code,
    but 3 for ``--execute`` of a plan only a person can relaunch (`by_hand`): nothing was
    relaunched, and a script must not read 0 or 1 as "the job is back". A job recover runs
    itself ends it with its own code (the CLI's)."""
    return EXIT_BAD_INPUT if executed and by_hand(plan) else plan.exit_code


def _header(plan: RecoveryPlan, executed: bool) -> str:
    """The first line: the verdict and the exit code this command ends with (`exit_code`)."""
    finished = plan.verdict == "finished"
    verdict = "FINISHED, nothing to recover" if finished else plan.verdict.upper()
    code = exit_code(plan, executed)
    if not by_hand(plan):
        return f"recover {plan.run_dir}: {verdict} (exit {code})"
    if executed:
        return f"recover {plan.run_dir}: {verdict} by hand (exit {code}: nothing relaunched, " \
               f"{BY_HAND})"
    return f"recover {plan.run_dir}: {verdict} (exit {code}); by hand: {BY_HAND}"


def render(plan: RecoveryPlan, executed: bool, decision: str | None) -> str:
    """The readable report: verdict, diagnosis with evidence, checkpoint and the ones passed
    over, exclusions, re-plan with its cost, why, and the command."""
    finished = plan.verdict == "finished"
    hand = by_hand(plan)
    lines = [_header(plan, executed), ""]
    lines += _diagnosis_lines(plan.diagnosis) + [""] + _decision_lines(plan) + [""]
    lines += ["why:"] + [f"  - {r}" for r in plan.reasons]
    if plan.command:
        # its relative paths are the job's: a command copied into another directory fails
        where = f", from {plan.cwd}" if plan.cwd else ""
        lines += ["", f"relaunch ({plan.launcher}{where}):", f"  {shlex.join(plan.command)}"]
    if executed:
        lines += ["", f"decision written to {decision}" + ("; relaunching" if plan.command
                                                             else "")]
    elif hand:
        lines += ["", f"dry run: nothing written; --execute would only record this decision "
                      f"and exit {EXIT_BAD_INPUT} (nothing relaunched): {NEXT_BY_HAND}"]
    elif plan.verdict == "unrecoverable":
        lines += ["", "dry run: nothing written; --execute would only record this decision"]
    elif not finished:
        lines += ["", "dry run: nothing written; add --execute to act"]
    return "\n".join(lines) + "\n"
