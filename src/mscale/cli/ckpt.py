"""``mscale ckpt``: list, verify, convert and pin checkpoints (docs/ckpt.md).

Thin: parse, call mscale.ckpt, print, choose the exit code. 0 OK, 2 verify failed (the bad file
is named), 3 bad input.
"""

from __future__ import annotations

from typing import Optional

import typer
from rich.table import Table

from mscale.cli.app import app
from mscale.cli.output import console, print_json
from mscale.ckpt.limits import MAX_LEVEL, MIN_LEVEL
from mscale.errors import EXIT_CRITICAL, EXIT_WARNING, MscaleError

ckpt_app = typer.Typer(help="List, verify, convert and pin checkpoints.", no_args_is_help=True)
app.add_typer(ckpt_app, name="ckpt")


def _layout(layout: dict | None) -> str:
    if not layout:
        return "-"
    return f"tp{layout['tp']} pp{layout['pp']} dp{layout['dp']} zero{layout['zero_stage']}"


def _size(n: int) -> str:
    for unit in ("B", "KB", "MB", "GB", "TB"):
        if n < 1000 or unit == "TB":
            return f"{n:.0f} {unit}" if unit == "B" else f"{n:.1f} {unit}"
        n /= 1000
    return str(n)  # pragma: no cover


@ckpt_app.command("ls")
def ls_cmd(
    run_dir: str = typer.Argument(..., help="Run directory (or its ckpt/ directory)."),
    as_json: bool = typer.Option(False, "--json", help="Print one JSON document."),
) -> None:
    """List a run's checkpoints: step, size, committed or partial, layout, which is latest.
    Exit 1 when something needs a look: a `latest` that names no checkpoint, a manifest that
    cannot be read, a directory whose name and manifest disagree on the step."""
    from mscale.ckpt import catalog
    from mscale.runs.atomic import fs_and_path

    fs_and_path(run_dir)  # an unknown protocol is named as the user typed it
    root = run_dir if catalog.basename(run_dir) == "ckpt" else catalog.join(run_dir, "ckpt")
    fs, path = fs_and_path(root)
    if not fs.isdir(path):
        raise MscaleError("no ckpt/ directory here", file=run_dir,
                          fix="pass a run directory that `mscale train --run-dir` wrote")
    latest, warnings = None, []
    try:
        latest = catalog.read_latest(root)
    except MscaleError as e:
        warnings.append(str(e))
    rows = [_row(e, latest, root) for e in catalog.entries(root)]
    if latest and not any(r["latest"] and r["status"] == "committed" for r in rows):
        warnings.append(f"{catalog.join(root, catalog.LATEST)} names {latest}, which is not a "
                        "committed checkpoint here; `mscale train` will refuse to resume")
    warnings += [f"{r['name']}: {r['note']}" for r in rows if r["note"]]
    if as_json:
        print_json({"run": run_dir, "latest": latest, "checkpoints": rows, "warnings": warnings})
    else:
        table = Table("checkpoint", "step", "status", "size", "layout", "latest", "pinned")
        for r in rows:
            table.add_row(r["name"], str(r["step"]), r["status"], _size(r["bytes"]),
                          _layout(r["layout"]), "*" if r["latest"] else "",
                          r["pin"]["reason"] if r["pin"] else "")
        console.print(table)
        for w in warnings:
            console.print(f"warning: {w}", soft_wrap=True, markup=False)
    if warnings:
        raise typer.Exit(EXIT_WARNING)


def _row(e, latest: str | None, root: str) -> dict:
    """One `ls` row: the step is the directory's; ``note`` says when the manifest disagrees;
    ``pin`` is its KEEP record (retention keeps it), or None."""
    from dataclasses import asdict

    from mscale.ckpt import catalog
    from mscale.ckpt.pins import read_pin

    note = None
    if e.problem:
        note = f"manifest.json cannot be read: {e.problem}"
    elif e.manifest_step is not None and e.manifest_step != e.step:
        note = f"its manifest is at step {e.manifest_step}, not the {e.step} its name says"
    status = "committed" if e.committed else "partial"
    if note:
        status += " (see warning)"
    try:
        pin = read_pin(catalog.join(root, e.name))
        pin = asdict(pin) if pin else None
    except MscaleError as err:  # a KEEP that is a directory, too large, unreadable: still a pin
        pin = {"reason": "KEEP present but unreadable", "who": "unknown", "time": 0.0}
        note = note or f"its KEEP file cannot be read ({err.message}); retention keeps it"
    return {"name": e.name, "step": e.step, "manifest_step": e.manifest_step, "status": status,
            "bytes": e.bytes, "layout": e.layout, "latest": e.name == latest, "note": note,
            "pin": pin}


@ckpt_app.command("pin")
def pin_cmd(
    path: str = typer.Argument(..., help="A committed checkpoint directory (RUN/ckpt/step-N)."),
    reason: str = typer.Option(..., "--reason", help="Why it is kept, in one sentence."),
    who: str = typer.Option("user", "--who", help="Who pins it."),
) -> None:
    """Keep a checkpoint whatever retention (--ckpt-keep) would delete: a KEEP file in it."""
    from mscale.ckpt.pins import pin

    pin(path, reason, who)
    console.print(f"pinned {path}: {reason}", soft_wrap=True, markup=False)


@ckpt_app.command("unpin")
def unpin_cmd(
    path: str = typer.Argument(..., help="A pinned checkpoint directory."),
) -> None:
    """Release a pin (recover's rollback target, watch's divergence target, or yours): the
    next retention pass may delete the checkpoint. Exit 1 when it was not pinned."""
    from mscale.ckpt import catalog
    from mscale.ckpt.manifest import MANIFEST
    from mscale.ckpt.pins import unpin
    from mscale.runs.atomic import fs_and_path

    fs, where = fs_and_path(catalog.join(path, MANIFEST))
    if not fs.isfile(where):
        raise MscaleError("not a checkpoint directory (no manifest.json)", file=path,
                          fix="pass a step-NNNNNN directory (mscale ckpt ls lists them)")
    if not unpin(path):
        console.print(f"{path} was not pinned", soft_wrap=True, markup=False)
        raise typer.Exit(EXIT_WARNING)
    console.print(f"unpinned {path}", soft_wrap=True, markup=False)


@ckpt_app.command("verify")
def verify_cmd(
    path: str = typer.Argument(..., help="Checkpoint directory, RUN/ckpt/latest, or a run."),
    quick: bool = typer.Option(False, "--quick", help="Check presence and sizes only."),
    as_json: bool = typer.Option(False, "--json", help="Print one JSON document."),
) -> None:
    """Check manifest, commit marker, coverage and every shard's checksum. Exit 2 names the bad
    file."""
    from mscale.ckpt.verify import verify

    report = verify(path, quick=quick)
    if as_json:
        print_json(report.to_json())
    elif report.ok:
        console.print(f"OK {report.path}: step {report.step}, {report.shards} shards, "
                      f"{report.tensors} tensors, {_size(report.bytes)}, {_layout(report.layout)}"
                      + (" (quick: sizes only)" if quick else ""), soft_wrap=True)
    else:
        table = Table("file", "field", "problem", title=f"FAILED {report.path}")
        for p in report.problems:
            table.add_row(p.file, p.field or "", p.message)
        console.print(table)
    if not report.ok:
        raise typer.Exit(EXIT_CRITICAL)


@ckpt_app.command("convert")
def convert_cmd(
    src: str = typer.Argument(..., help="Checkpoint (or run) to read, or an HF directory."),
    dst: str = typer.Argument(..., help="Directory to write."),
    plan: Optional[str] = typer.Option(None, "--plan", help="Write an mscale checkpoint laid out "
                                       "for this plan (another TP/PP/DP/ZeRO layout)."),
    to_hf: bool = typer.Option(False, "--to-hf", help="Write a consolidated HuggingFace-style "
                               "safetensors directory (LLaMA names, config.json)."),
    level: int = typer.Option(1, "--zstd-level", min=MIN_LEVEL, max=MAX_LEVEL,
                              help="zstd level of the written chunks; 0 = raw."),
    as_json: bool = typer.Option(False, "--json", help="Print one JSON document."),
) -> None:
    """Convert offline: to another layout (--plan), to HF safetensors (--to-hf), or from an HF
    directory to a model-only checkpoint that `mscale train --resume DST` starts from."""
    from mscale.ckpt.convert import convert

    if bool(plan) == to_hf:
        raise MscaleError("say what to write: --plan PLAN (an mscale checkpoint at that layout) "
                          "or --to-hf", field="--plan/--to-hf",
                          fix="e.g. mscale ckpt convert runs/r1 out --plan plans/other.yaml")
    result = convert(src, dst, plan=plan, to_hf=to_hf, level=level)
    if as_json:
        print_json(result)
        return
    console.print(f"wrote {result['dst']} ({result['format']}, {result['tensors']} tensors, "
                  f"{_size(result['bytes'])}) from {result['src']}", soft_wrap=True)
    if result.get("note"):
        console.print(f"note: {result['note']}", soft_wrap=True, markup=False)
