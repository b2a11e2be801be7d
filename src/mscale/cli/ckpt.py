"""``mscale ckpt``: list, verify, convert and pin checkpoints (docs/ckpt.md).

Thin: parse, call mscale.ckpt, print, choose the exit code. 0 OK, 2 verify failed (the bad file
is named), 3 bad input. `convert` and `verify` can run for hours on a large checkpoint: they say
what they start on and how far they are on stderr (cli/progress.py: throttled, nothing between
the start and the closing line for work shorter than one interval), so that stdout stays the
result and, with --json, one document.
"""

from __future__ import annotations

import os
import shlex
from typing import Optional

import typer
from rich.table import Table

from mscale.cli.app import app
from mscale.cli.output import console, counted, print_json
from mscale.cli.progress import ThrottledLine
from mscale.ckpt.limits import MAX_LEVEL, MIN_LEVEL
from mscale.errors import EXIT_CRITICAL, EXIT_WARNING, MscaleError

ckpt_app = typer.Typer(help="List, verify, convert and pin checkpoints.", no_args_is_help=True)
app.add_typer(ckpt_app, name="ckpt")

TICK_S = 1.0
"""On a terminal, the progress line is redrawn at most this often (seconds)."""
PLAIN_EVERY_S = 5.0
"""Elsewhere (a log, CI), a progress line at most this often: a 70B conversion logs a line per
5 s, a small one none. Module settings, so that a test can shorten them instead of sleeping."""


class BytesLine(ThrottledLine):
    """``convert: 1.2 GB of 4.8 GB (25%), 310.0 MB/s, 4 s, about 12 s left``: the callable that
    mscale.ckpt calls as ``progress(done, total)``."""

    def __call__(self, done: int, total: int) -> None:
        if self.due():
            self.show(self.text(done, total))

    def text(self, done: int, total: int) -> str:
        from mscale.ckpt.listing import format_bytes

        elapsed = self.elapsed()
        rate = done / elapsed
        share = 100 * done / total if total else 100
        left = (f", about {_duration((total - done) / rate)} left" if 0 < done < total else "")
        return (f"{self.label}: {format_bytes(done)} of {format_bytes(total)} ({share:.0f}%), "
                f"{format_bytes(rate)}/s, {_duration(elapsed)}{left}")

    def starter(self, describe):
        """The ``on_start`` callable: the start line (``describe(info)``), then time counts."""
        def on_start(info: dict) -> None:
            self.say(f"{self.label}: {describe(info)}")
            self.restart()

        return on_start


def _duration(seconds: float) -> str:
    """``45 s``, ``12 min``, ``2.5 h``."""
    if seconds < 90:
        return f"{seconds:.0f} s"
    if seconds < 90 * 60:
        return f"{seconds / 60:.0f} min"
    return f"{seconds / 3600:.1f} h"


def _progress_line(label: str) -> BytesLine:
    return BytesLine(label, tick_s=TICK_S, plain_every_s=PLAIN_EVERY_S)


def _convert_start(info: dict) -> str:
    """``runs/r1/ckpt/step-000005 → out, mscale at tp4 pp1 dp2 zero1 (8 ranks): 24 tensors,
    1.2 GB before compression`` (the bytes the progress lines count)."""
    from mscale.ckpt.listing import format_bytes, layout_text

    if "files" in info:
        what = f"HF safetensors in {info['files']} file(s)"
        size = format_bytes(info["bytes"])
    else:
        what = (f"{info['format']} at {layout_text(info['layout'])} "
                f"({counted(info['ranks'], 'rank')})")
        size = f"{format_bytes(info['bytes'])} before compression"
    skipped = ""
    if info.get("not_read"):  # stray files beside a sharded model's index
        from mscale.ckpt.hf_files import INDEX

        skipped = (f"; not read, not in {INDEX}: "
                   + ", ".join(info["not_read"][:5])
                   + (f" and {len(info['not_read']) - 5} more" if len(info["not_read"]) > 5
                      else ""))
    return (f"{info['src']} → {info['dst']}, {what}: {counted(info['tensors'], 'tensor')}, "
            f"{size}{skipped}")


def _verify_start(info: dict) -> str:
    """``runs/r1/ckpt/step-000005, step 5, 4 shards, 24 tensors, 1.2 GB on disk (1.1 GB in
    shards): reading every chunk``: the size on disk is what ``ls`` shows, the shards' what the
    progress lines count."""
    from mscale.ckpt.listing import format_bytes

    how = "shard sizes only (--quick)" if info["quick"] else "reading every chunk"
    return (f"{info['path']}, step {info['step']}, {counted(info['shards'], 'shard')}, "
            f"{counted(info['tensors'], 'tensor')}, {format_bytes(info['bytes'])} on disk "
            f"({format_bytes(info['shard_bytes'])} in shards): {how}")


@ckpt_app.command("ls")
def ls_cmd(
    run_dir: str = typer.Argument(..., help="Run directory (or its ckpt/ directory), or one "
                                  "checkpoint (RUN_DIR/ckpt/step-NNNNNN) to list alone."),
    as_json: bool = typer.Option(False, "--json", help="Print one JSON document."),
) -> None:
    """List a run's checkpoints (or one, named alone): step, size on disk, committed or
    partial, layout, which is latest.
    Exit 1 when something needs a look: a `latest` that names no checkpoint, a manifest that
    cannot be read, a directory whose name and manifest disagree on the step."""
    from mscale.ckpt.listing import format_bytes, layout_text, list_checkpoints

    listing = list_checkpoints(run_dir)
    if as_json:
        print_json(listing.to_json())
    else:
        table = Table("checkpoint", "step", "status", "size on disk", "layout", "latest",
                      "pinned")
        for r in listing.checkpoints:
            table.add_row(r["name"], "-" if r["step"] is None else str(r["step"]), r["status"],
                          format_bytes(r["bytes"]), layout_text(r["layout"]),
                          "*" if r["latest"] else "", r["pin"]["reason"] if r["pin"] else "")
        console.print(table)
        if listing.run_dir is not None:
            console.print(f"{listing.checkpoints[0]['name']} alone: `mscale ckpt ls "
                          f"{shlex.quote(listing.run_dir)}` lists every checkpoint of the run",
                          soft_wrap=True, markup=False)
        for w in listing.warnings:
            console.print(f"warning: {w}", soft_wrap=True, markup=False)
    if listing.warnings:
        raise typer.Exit(EXIT_WARNING)


@ckpt_app.command("pin")
def pin_cmd(
    path: str = typer.Argument(..., help="A committed checkpoint directory (RUN/ckpt/step-N), "
                               "or RUN/ckpt/latest for the one it names now."),
    reason: str = typer.Option(..., "--reason", help="Why it is kept, in one sentence."),
    who: str = typer.Option("user", "--who", help="Who pins it."),
) -> None:
    """Keep a checkpoint whatever retention (--ckpt-keep) would delete: a KEEP file in it."""
    from mscale.ckpt.pins import pin, target

    path = target(path)
    pin(path, reason, who)
    console.print(f"pinned {path}: {reason}", soft_wrap=True, markup=False)


@ckpt_app.command("unpin")
def unpin_cmd(
    path: str = typer.Argument(..., help="A pinned checkpoint directory, or RUN/ckpt/latest."),
) -> None:
    """Release a pin (recover's rollback target, watch's divergence target, or yours): the
    next retention pass may delete the checkpoint. Exit 1 when it was not pinned."""
    from mscale.ckpt.pins import target, unpin

    path = target(path)
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

    line = _progress_line("verify")
    try:
        report = verify(path, quick=quick, progress=line, on_start=line.starter(_verify_start))
    finally:
        line.close()
    if as_json:
        print_json(report.to_json())
    elif report.ok:
        console.print(f"OK {report.path}: step {report.step}, {counted(report.shards, 'shard')}"
                      f", {counted(report.tensors, 'tensor')}, {format_bytes(report.bytes)} on "
                      f"disk, {layout_text(report.layout)}"
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
    line = _progress_line("convert")
    try:
        result = convert(src, dst, plan=plan, to_hf=to_hf, level=level, progress=line,
                         on_start=line.starter(_convert_start))
    finally:
        line.close()
    if as_json:
        print_json(result)
        return
    size = format_bytes(result["bytes"]) + ("" if to_hf else " on disk")
    console.print(f"wrote {result['dst']} ({result['format']}, "
                  f"{counted(result['tensors'], 'tensor')}, "
                  f"{size}) from {result['src']}", soft_wrap=True)
    if result.get("note"):
        console.print(f"note: {result['note']}", soft_wrap=True, markup=False)
    if plan:
        console.print(f"next: {_train_from(plan, result)} trains from it (under your launcher: "
                      "--local N, srun or torchrun)", soft_wrap=True, markup=False)


def _train_from(plan: str, result: dict) -> str:
    """The train command that starts from a converted checkpoint: its run's, when the run's
    ``latest`` names it (``--resume auto`` loads it), else one that names it."""
    # Quoted: the line is for copying into a shell, and a path with a space (`runs/run 2`)
    # printed bare splits into two arguments there.
    q = shlex.quote
    dst = result["dst"]
    if "latest" not in result:  # not inside a run: the run to train is the user's choice
        return f"mscale train {q(plan)} --resume {q(dst)} --run-dir RUN"
    run = os.path.dirname(os.path.dirname(dst.rstrip("/"))) or "."
    resume = ("" if result["latest"] == os.path.basename(dst.rstrip("/"))
              else f" --resume {q(dst)}")
    return f"mscale train {q(plan)} --run-dir {q(run)}{resume}"
