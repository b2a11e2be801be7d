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


@ckpt_app.command("ls")
def ls_cmd(
    run_dir: str = typer.Argument(..., help="Run directory (or its ckpt/ directory)."),
    as_json: bool = typer.Option(False, "--json", help="Print one JSON document."),
) -> None:
    """List a run's checkpoints: step, size, committed or partial, layout, which is latest.
    Exit 1 when something needs a look: a `latest` that names no checkpoint, a manifest that
    cannot be read, a directory whose name and manifest disagree on the step."""
    from mscale.ckpt.listing import format_bytes, layout_text, list_checkpoints

    listing = list_checkpoints(run_dir)
    if as_json:
        print_json(listing.to_json())
    else:
        table = Table("checkpoint", "step", "status", "size", "layout", "latest", "pinned")
        for r in listing.checkpoints:
            table.add_row(r["name"], str(r["step"]), r["status"], format_bytes(r["bytes"]),
                          layout_text(r["layout"]), "*" if r["latest"] else "",
                          r["pin"]["reason"] if r["pin"] else "")
        console.print(table)
        for w in listing.warnings:
            console.print(f"warning: {w}", soft_wrap=True, markup=False)
    if listing.warnings:
        raise typer.Exit(EXIT_WARNING)


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
    from mscale.ckpt.pins import unpin

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
    from mscale.ckpt.listing import format_bytes, layout_text
    from mscale.ckpt.verify import verify

    report = verify(path, quick=quick)
    if as_json:
        print_json(report.to_json())
    elif report.ok:
        console.print(f"OK {report.path}: step {report.step}, {report.shards} shards, "
                      f"{report.tensors} tensors, {format_bytes(report.bytes)}, "
                      f"{layout_text(report.layout)}"
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
    from mscale.ckpt.listing import format_bytes

    if plan and to_hf:
        raise MscaleError("--plan and --to-hf both given: one convert writes one format",
                          field="--plan/--to-hf", fix="run one convert per output: --plan PLAN "
                          "for an mscale checkpoint at that layout, --to-hf for safetensors")
    if not plan and not to_hf:
        raise MscaleError("say what to write: --plan PLAN (an mscale checkpoint at that layout) "
                          "or --to-hf", field="--plan/--to-hf",
                          fix="e.g. mscale ckpt convert runs/r1 out --plan plans/other.yaml")
    from mscale.runs.targets import check_lasting

    check_lasting(dst, "DST")
    result = convert(src, dst, plan=plan, to_hf=to_hf, level=level)
    if as_json:
        print_json(result)
        return
    console.print(f"wrote {result['dst']} ({result['format']}, {result['tensors']} tensors, "
                  f"{format_bytes(result['bytes'])}) from {result['src']}", soft_wrap=True)
    if result.get("note"):
        console.print(f"note: {result['note']}", soft_wrap=True, markup=False)
