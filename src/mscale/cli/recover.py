"""``mscale recover RUN_DIR``: diagnose a failed run, choose the checkpoint, keep bad nodes out,
re-plan and print (or, with ``--execute``, carry out) the relaunch.

``recover`` is a group whose default command takes the run directory, so ``mscale recover RUN``
and ``mscale recover supervise -- CMD ...`` (added by `mscale.cli.recover_supervise`) both parse:
a first word that is not a subcommand, or that is an existing run directory and is not followed by
``--``, goes to ``diagnose`` (``mscale recover diagnose RUN`` names it explicitly; ``./supervise``
also reaches a run directory called ``supervise``).
Exit 0 relaunchable, 1 degraded, 2 unrecoverable, 3 bad input (or a relaunch that failed).
"""

from __future__ import annotations

import os
import shlex
import sys

import typer
from typer.core import TyperGroup

from mscale.cli.app import HELP_OPTION_NAMES, app
from mscale.errors import EXIT_BAD_INPUT, MscaleError

DEFAULT_COMMAND = "diagnose"
EVIDENCE_LINES = 5
"""Evidence lines the report shows (most telling first); --json has them all."""
LINE_CHARS = 160
"""An evidence line is cut here in the report (a gloo error runs to 300 characters)."""
RANKS_NAMED = 8
"""Other ranks named on an evidence line many ranks wrote (the rest are counted)."""


def _is_run_dir(word: str) -> bool:
    """A local directory that holds what a run directory holds."""
    return os.path.isdir(word) and any(os.path.exists(os.path.join(word, name))
                                       for name in ("events.jsonl", "plan.yaml", "ckpt", "logs"))


class DefaultCommandGroup(TyperGroup):
    """A group that sends its first word to ``diagnose`` unless it names a subcommand (and is not
    a run directory given without ``--``: ``mscale recover runs/x`` where ``x`` is
    ``supervise``)."""

    def parse_args(self, ctx, args: list[str]) -> list[str]:
        if args and args[0] not in HELP_OPTION_NAMES and (
                args[0] not in self.commands or (_is_run_dir(args[0]) and "--" not in args)):
            args = [DEFAULT_COMMAND, *args]
        return super().parse_args(ctx, args)


recover_app = typer.Typer(
    cls=DefaultCommandGroup, no_args_is_help=True, add_completion=False,
    context_settings={"help_option_names": HELP_OPTION_NAMES},
    help="Recover a failed run: `mscale recover RUN_DIR` (dry run; --execute to act), or "
         "`mscale recover supervise -- LAUNCH COMMAND...`. Exit 0 relaunchable, 1 degraded, "
         "2 unrecoverable, 3 bad input.")
app.add_typer(recover_app, name="recover")


@recover_app.command(DEFAULT_COMMAND)
def recover_cmd(
    run_dir: str = typer.Argument(..., help="Run directory of the failed job (path or URL)."),
    execute: bool = typer.Option(False, "--execute", help="Act: write the new plan, the data "
                                 "skip, the checkpoint pin, the decision and event, then "
                                 "relaunch. Default: print the plan, write nothing."),
    as_json: bool = typer.Option(False, "--json", help="Print the plan as one JSON document."),
    allow_batch_change: bool = typer.Option(False, "--allow-batch-change", help="Let the "
                                            "re-plan change the global batch when no layout "
                                            "keeps it on the remaining nodes."),
    no_recheck: bool = typer.Option(False, "--no-recheck", help="Do not re-check suspect nodes "
                                    "with preflight; the evidence alone decides."),
    verify: str = typer.Option("quick", "--verify", help="Checkpoint verification: quick "
                               "(manifest, commit marker, sizes) or full (every chunk's crc)."),
) -> None:
    """Diagnose the run's failure and print the relaunch plan (the default command)."""
    from mscale.recover.decide import RecoverOptions, apply_plan, launch, plan_recovery

    if verify not in ("quick", "full"):
        raise MscaleError(f"--verify {verify!r} is not quick or full", field="--verify",
                          fix="use --verify quick or --verify full")
    opts = RecoverOptions(execute=execute, allow_batch_change=allow_batch_change,
                          recheck=not no_recheck, verify=verify)
    plan = plan_recovery(run_dir, opts)
    code, decision, rc = plan.exit_code, None, None
    if execute:
        decision = apply_plan(plan)
    if not as_json:
        sys.stdout.write(render(plan, executed=execute, decision=decision))
        sys.stdout.flush()
    if execute and plan.command:
        rc = launch(plan, stdout=2 if as_json else None)  # fd 2: stdout holds the document
        if rc != 0:
            code = EXIT_BAD_INPUT
            if not as_json:
                sys.stderr.write(f"error: the relaunch exited with code {rc}\n")
    if as_json:
        from mscale.cli.output import print_json

        print_json({**plan.to_json(), "decision": decision, "launch_exit_code": rc,
                    "exit_code": code})
    raise typer.Exit(code)


def _step_time(rp) -> str:
    old, new = rp.old_step_time_s, rp.new_step_time_s
    if old is None or new is None:
        return "predicted step time unknown"
    pct = f" ({(new / old - 1) * 100:+.0f}%)" if old > 0 else ""
    return f"predicted step time {old:.3g} s -> {new:.3g} s{pct}"


def _evidence_line(ev) -> str:
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
    from mscale.recover.diagnose.classify import SOURCE_LOCATION

    text = SOURCE_LOCATION.sub("", ev.text)
    room = max(LINE_CHARS - len(head) - len(tail), 20)
    return head + (text if len(text) <= room else text[: room - 1] + "…") + tail


def _diagnosis_lines(d) -> list[str]:
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


def _decision_lines(plan) -> list[str]:
    c, ex, rp = plan.checkpoint, plan.exclusions, plan.replan
    out = [f"checkpoint: {c.path} (step {c.step}) — {c.reason}" if c.path else
           f"checkpoint: none — {c.reason}"]
    out += [f"  passed over {r.get('name')}: {r.get('why')}" for r in c.rejected]
    out.append("exclusions: none" if not ex.nodes else f"exclusions: {len(ex.nodes)} node(s)")
    out += [f"  {n}: {ex.reasons.get(n, '')}" for n in ex.nodes]
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


def render(plan, executed: bool, decision: str | None) -> str:
    """The readable report: verdict, diagnosis with evidence, checkpoint and the ones passed
    over, exclusions, re-plan with its cost, why, and the command."""
    finished = plan.diagnosis.symptom == "finished"  # "relaunchable" would mislead a person
    verdict = "FINISHED, nothing to recover" if finished else plan.verdict.upper()
    lines = [f"recover {plan.run_dir}: {verdict} (exit {plan.exit_code})", ""]
    lines += _diagnosis_lines(plan.diagnosis) + [""] + _decision_lines(plan) + [""]
    lines += ["why:"] + [f"  - {r}" for r in plan.reasons]
    if plan.command:
        lines += ["", f"relaunch ({plan.launcher}):", f"  {shlex.join(plan.command)}"]
    if executed:
        lines += ["", f"decision written to {decision}" + ("; relaunching" if plan.command
                                                             else "")]
    elif plan.verdict == "unrecoverable":
        lines += ["", "dry run: nothing written; --execute would only record this decision"]
    elif not finished:
        lines += ["", "dry run: nothing written; add --execute to act"]
    return "\n".join(lines) + "\n"
