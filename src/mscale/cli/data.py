"""``mscale data``: tokenize corpora into shards, train a small tokenizer, inspect and verify token
data (docs/data.md).

Thin: parse, call mscale.data, print, choose the exit code. 0 OK, 1 ``--skip-bad`` skipped
something (prepare, tokenizer), 2 verify found a checksum mismatch (the shard is named), 3 bad
input. Progress goes to stderr (one line redrawn on a terminal, a plain line every few seconds
elsewhere) so that ``--json`` leaves stdout one document.
"""

from __future__ import annotations

import signal
import time
from typing import List, Optional

import typer

from mscale.cli.app import app
from mscale.cli.interrupt import stop_signals_as_interrupt
from mscale.cli.output import console, counted, print_json
from mscale.cli.progress import ThrottledLine
from mscale.errors import EXIT_CRITICAL, EXIT_WARNING

data_app = typer.Typer(help="Tokenize corpora into shards, train a tokenizer, inspect and verify "
                            "token data.", no_args_is_help=True)
app.add_typer(data_app, name="data")

_SHARD_TOKENS = 1 << 28
"""mscale.data.prepare.SHARD_TOKENS, not imported here: every command would load numpy."""


def _n(x: float) -> str:
    """12,345 below a million, then 1.23M / 4.56B."""
    for unit, div in (("B", 1e9), ("M", 1e6)):
        if abs(x) >= div:
            return f"{x / div:.2f}{unit}"
    return f"{x:,.0f}"


def _mb(n: int) -> str:
    return f"{n / 1e6:,.1f} MB" if n >= 100_000 else f"{n / 1e3:,.1f} KB"


class ProgressLine(ThrottledLine):
    """What a tokenizing job is at: documents, tokens, bytes read of the input, tokens/s
    (cli/progress.py says where and how often)."""

    def __init__(self, label: str, stream=None, tick_s: float = 0.5, plain_every_s: float = 2.0,
                 clock=time.monotonic) -> None:
        super().__init__(label, stream, tick_s, plain_every_s, clock)
        self.total_bytes: int | None = None

    def text(self, documents: int, tokens: int | None, nbytes: int, pending: int = 0,
             note: str = "") -> str:
        elapsed = self.elapsed()
        parts = [counted(documents, "document")]
        if tokens is not None:
            parts.append(f"{_n(tokens)} tokens")
        read = _mb(nbytes)
        if self.total_bytes:
            share = min(100, 100 * nbytes / self.total_bytes)
            read += f" of {_mb(self.total_bytes)} ({share:.0f}%)"
        parts.append(read)
        if tokens is not None:
            parts.append(f"{_n(tokens / elapsed)} tokens/s")
        text = f"{self.label}: " + ", ".join(parts) + f", {elapsed:.0f} s"
        if pending:  # one large document is one batch: minutes without another figure moving
            text += f"; {_mb(pending)} being tokenized"
        return text + (f"; {note}" if note else "")

    def __call__(self, documents: int, tokens: int | None, nbytes: int = 0,
                 pending: int = 0, note: str = "") -> None:
        if self.due():
            self.show(self.text(documents, tokens, nbytes, pending, note))


def _inputs_shown(inputs: list[str]) -> str:
    return ", ".join(inputs[:3]) + (f" (+{len(inputs) - 3} more)" if len(inputs) > 3 else "")


@data_app.command("prepare")
def prepare_cmd(
    inputs: List[str] = typer.Argument(..., help="Files, folders (recursive) or quoted globs: "
                                       ".txt (one document per file), .jsonl (one per line), "
                                       ".parquet (one per row); .gz/.zst/.bz2/.xz too; local "
                                       "paths or fsspec URLs."),
    tokenizer: str = typer.Option(..., "--tokenizer", help="A local tokenizer.json, or a folder "
                                  "holding one (a HuggingFace model folder); never downloaded."),
    out: str = typer.Option(..., "--out", "-o", help="Folder to create: shard-NNNNN.bin/.idx "
                            "and manifest.json (local)."),
    workers: Optional[int] = typer.Option(None, "--workers", min=1, help="Tokenizer processes "
                                          "(default: one per CPU)."),
    text_field: str = typer.Option("text", "--text-field", help="The text field of .jsonl lines."),
    column: str = typer.Option("text", "--column", help="The text column of .parquet files."),
    text_ext: List[str] = typer.Option([], "--text-ext", help="Also read files with this "
                                       "extension as plain text, one document per file "
                                       "(repeatable, e.g. --text-ext .py)."),
    shard_tokens: int = typer.Option(_SHARD_TOKENS, "--shard-tokens", min=1,
                                     help="Tokens per shard at most (a longer document gets a "
                                          "shard of its own)."),
    eod: Optional[str] = typer.Option(None, "--eod", help="End-of-document token (or id) "
                                      "appended to every document (default: the tokenizer's "
                                      "<|endoftext|>, </s>, <eos>, ...)."),
    force: bool = typer.Option(False, "--force", help="Replace an existing --out folder (a "
                               "token folder), once the new one is complete."),
    skip_bad: bool = typer.Option(False, "--skip-bad", help="Skip an unreadable .jsonl line or "
                                  "file (not UTF-8, not JSON, no text field or column) with a "
                                  "line saying so, listed in the manifest; exit 1 when any was "
                                  "skipped. Default: the first one stops prepare (exit 3)."),
    as_json: bool = typer.Option(False, "--json", help="Print the manifest as JSON."),
) -> None:
    """Tokenize text into Megatron-format token shards with a manifest of checksums, in parallel
    worker processes; the output is the same whatever --workers is."""
    from mscale.data.prepare import prepare

    line = ProgressLine("prepare")

    def on_start(info: dict) -> None:
        if info["bytes_known"]:
            line.total_bytes = info["bytes"]
        line.say(f"prepare: {info['files']:,} file(s), {_mb(info['bytes'])}, from "
                 f"{_inputs_shown(inputs)}; "
                 f"tokenizer {info['tokenizer']} (vocab {info['vocab_size']:,}, eod "
                 f"{info['eod_id']} {info['eod_token']!r}, {info['dtype']}); "
                 f"{info['workers']} worker(s) → {out}")
        line.restart()

    t0 = time.monotonic()
    try:
        # SIGTERM (scancel, a CI timeout) stops like Ctrl-C: prepare removes its temporary folder
        with stop_signals_as_interrupt(signal.SIGTERM):
            m = prepare(inputs, tokenizer, out, text_field=text_field, column=column,
                        workers=workers, shard_tokens=shard_tokens, eod=eod, text_exts=text_ext,
                        force=force, progress=line, on_start=on_start,
                        on_skip=_skip_reporter(line, "the manifest lists them")
                        if skip_bad else None)
    except KeyboardInterrupt:
        line.close()
        line.say(f"prepare: interrupted; nothing was written to {out}"
                 + (" (the old folder is kept)" if force else ""))
        raise typer.Exit(130) from None
    finally:
        line.close()
    seconds = max(time.monotonic() - t0, 1e-9)
    if as_json:
        print_json(m)
        if m.get("skipped_count", 0):
            raise typer.Exit(EXIT_WARNING)  # as without --json: something was skipped
        return
    skipped = m.get("empty_documents_skipped", 0)
    console.print(f"wrote {out}: {len(m['shards'])} shard(s), "
                  f"{counted(m['documents'], 'document')}, "
                  f"{m['tokens']:,} tokens ({m['dtype']}) in {seconds:.1f} s: "
                  f"{_n(m['tokens'] / seconds)} tokens/s"
                  + (f"; {skipped:,} empty document(s) skipped" if skipped else ""),
                  soft_wrap=True, markup=False)
    _warn_skipped(m, f"listed in {out}/manifest.json under \"skipped\"")


SKIPS_SHOWN = 20
"""Skipped records named on the console, a line each; the manifest (or --json) lists more."""
SKIPS_NAMED = 3
"""Skipped records named again in the closing WARNING line, so that the last line says where."""


def _skip_reporter(line: "ProgressLine", listed: str):
    """``--skip-bad``: a line per skipped record, the first SKIPS_SHOWN, then one saying more
    and where they are ``listed``."""
    seen = [0]

    def report(e) -> None:
        seen[0] += 1
        if seen[0] <= SKIPS_SHOWN:
            line.say(f"skipped {e.file}: {e.message}")
        elif seen[0] == SKIPS_SHOWN + 1:
            line.say(f"skipped more ({listed}); only the first {SKIPS_SHOWN} are shown")

    return report


def _warn_skipped(result: dict, listed: str) -> None:
    """The closing WARNING line and exit 1 when ``--skip-bad`` skipped anything (``result``: a
    manifest or the tokenizer's report); nothing without --skip-bad or when nothing was."""
    bad = result.get("skipped_count", 0)
    if not bad:
        return
    first = ", ".join(str(s["where"]) for s in result["skipped"][:SKIPS_NAMED])
    console.print(f"WARNING {bad:,} unreadable record(s) or file(s) skipped (--skip-bad), "
                  f"first {first}{', ...' if bad > SKIPS_NAMED else ''}; {listed}",
                  soft_wrap=True, markup=False)
    raise typer.Exit(EXIT_WARNING)


@data_app.command("tokenizer")
def tokenizer_cmd(
    inputs: List[str] = typer.Argument(..., help="Text to train on: what `data prepare` reads."),
    vocab: int = typer.Option(..., "--vocab", help="Vocabulary size, <|endoftext|> and the 256 "
                              "bytes included (1,000-4,000 suits a few MB of text)."),
    out: str = typer.Option("tokenizer.json", "--out", "-o", help="The tokenizer.json to write."),
    text_field: str = typer.Option("text", "--text-field", help="The text field of .jsonl lines."),
    column: str = typer.Option("text", "--column", help="The text column of .parquet files."),
    text_ext: List[str] = typer.Option([], "--text-ext", help="Also read this extension as "
                                       "plain text (repeatable)."),
    force: bool = typer.Option(False, "--force", help="Overwrite an existing --out."),
    skip_bad: bool = typer.Option(False, "--skip-bad", help="As `data prepare --skip-bad`: skip "
                                  "an unreadable .jsonl line or file with a line saying so "
                                  "(--json lists them); exit 1 when any was skipped. Default: "
                                  "the first one stops (exit 3)."),
    as_json: bool = typer.Option(False, "--json", help="Print one JSON document."),
) -> None:
    """Train a byte-level BPE tokenizer (GPT-2's scheme, <|endoftext|> = 0) locally: for demos
    and tests on text of your own; real runs use the model's tokenizer.json."""
    from mscale.data.tokenizer import train_tokenizer

    line = ProgressLine("tokenizer")

    def on_start(info: dict) -> None:
        if info["bytes_known"]:
            line.total_bytes = info["bytes"]
        line.say(f"tokenizer: {info['files']:,} file(s), {_mb(info['bytes'])}, from "
                 f"{_inputs_shown(inputs)}; byte-level BPE, vocab {info['vocab_size']:,} → "
                 f"{info['out']}")
        line.restart()

    def progress(documents: int, nbytes: int, merging_s: float | None) -> None:
        line(documents, None, nbytes,
             note="" if merging_s is None else f"computing merges, {merging_s:.0f} s")

    t0 = time.monotonic()
    try:
        # SIGTERM stops like Ctrl-C: the training thread is a daemon, nothing half-written stays
        with stop_signals_as_interrupt(signal.SIGTERM):
            r = train_tokenizer(inputs, vocab, out, text_field=text_field, column=column,
                                text_exts=text_ext, force=force, progress=progress,
                                on_start=on_start,
                                on_skip=_skip_reporter(line, "--json lists them")
                                if skip_bad else None)
    except KeyboardInterrupt:
        line.close()
        line.say(f"tokenizer: interrupted; nothing was written to {out}"
                 + (" (the old file is kept)" if force else ""))
        raise typer.Exit(130) from None
    finally:
        line.close()
    r["seconds"] = round(time.monotonic() - t0, 3)
    if as_json:
        print_json(r)
        if r.get("skipped_count", 0):
            raise typer.Exit(EXIT_WARNING)  # as prepare --json: something was skipped
        return
    console.print(f"wrote {r['out']}: byte-level BPE, vocab {r['vocab_size']:,}, <|endoftext|> = "
                  f"{r['eod_id']}, trained on {counted(r['documents'], 'document')} "
                  f"({_mb(r['bytes'])}) "
                  f"in {r['seconds']:.1f} s", soft_wrap=True, markup=False)
    _warn_skipped(r, "--json lists them")


def _describe(spec: str, dtype: str | None) -> dict:
    from mscale.data.datasets import open_dataset, uint32_read_as_uint16

    ds = open_dataset(spec, dtype=dtype, check_indexes=True)  # one process: check them all
    # training refuses this file at the default dtype (blend.check_vocab): say so here too
    misread = None if dtype else uint32_read_as_uint16(ds)
    if ds.vocab_size is not None:
        kind = "mscale shards"
    elif ds.shards[0].documents is not None:
        kind = "megatron"
    else:
        kind = "flat"
    shards = [{"url": s.blob.url, "tokens": s.tokens,
               "documents": s.documents,
               "bytes": s.blob.size} for s in ds.shards]
    return {"spec": spec, "kind": kind, "tokens": ds.num_tokens, "documents": ds.documents,
            "dtype": ds.dtype.name, "vocab_size": ds.vocab_size, "eod_id": ds.eod_id,
            "shards": shards, "warnings": [_misread_warning(misread)] if misread else []}


def _misread_warning(why: str) -> str:
    return (f"read as uint16 (the default without --dtype), but {why}, and the figures here "
            "count 2-byte ids; fix: --dtype uint32 (data.dtype: uint32 in a training file, "
            "which refuses it until then), or --dtype uint16 if every second id really is 0")


@data_app.command("inspect")
def inspect_cmd(
    spec: str = typer.Argument(..., help="A prepared folder (manifest.json), a Megatron prefix "
                               "or its .bin/.idx, a flat token file, or a folder/glob of them."),
    dtype: Optional[str] = typer.Option(None, "--dtype", metavar="uint16|uint32",
                                        help="Token type of a flat file "
                                        "(uint16 or uint32; default uint16)."),
    stats: bool = typer.Option(False, "--stats", help="Also the unigram entropy (nats per "
                               "token): the loss of a model that ignores context, the bar a "
                               "held-out loss must get under."),
    as_json: bool = typer.Option(False, "--json", help="Print one JSON document."),
) -> None:
    """What training would read from SPEC: its kind, tokens, documents, dtype, vocabulary, EOD
    and shards. Structure is checked (sizes, index); checksums are `data verify`'s. A flat
    file that looks like uint32 ids read at the uint16 default is a WARNING line, exit 1."""
    from rich.table import Table

    d = _describe(spec, dtype)
    if stats:
        from mscale.data.datasets import open_dataset
        from mscale.data.stats import unigram_entropy

        d["unigram_entropy"], d["unigram_tokens_counted"] = unigram_entropy(
            open_dataset(spec, dtype=dtype))
    if as_json:
        print_json(d)
        if d["warnings"]:
            raise typer.Exit(EXIT_WARNING)
        return
    extra = ""
    if d["vocab_size"] is not None:
        extra = f", vocab {d['vocab_size']:,}, eod {d['eod_id']}"
    docs = ("no document boundaries" if d["documents"] is None
            else counted(d["documents"], "document"))
    console.print(f"{spec}: {d['kind']}, {d['tokens']:,} tokens, {docs}, {d['dtype']}{extra}, "
                  f"{len(d['shards'])} shard(s)", soft_wrap=True, markup=False)
    table = Table("shard", "tokens", "documents", "bytes")
    for s in d["shards"]:
        table.add_row(s["url"], f"{s['tokens']:,}",
                      "-" if s["documents"] is None else f"{s['documents']:,}", f"{s['bytes']:,}")
    console.print(table)
    if stats:
        console.print(f"unigram entropy {d['unigram_entropy']:.4f} nats/token over "
                      f"{d['unigram_tokens_counted']:,} tokens: a held-out loss below it has "
                      "learned from context", soft_wrap=True, markup=False)
    for warning in d["warnings"]:
        console.print(f"WARNING {spec}: {warning}", soft_wrap=True, markup=False)
    if d["warnings"]:
        raise typer.Exit(EXIT_WARNING)


def _verify_fix(spec: str, prepared: bool) -> str:
    """What to do with a damaged source, by its kind: a prepared folder is prepared again with
    --force (its manifest names the text), into a new folder when its manifest is unreadable
    (--force replaces only a folder it can tell is a token folder: `load_manifest`'s fix); a
    Megatron pair (the only other kind whose damage verify reports) cannot be rebuilt by
    prepare, which reads text and writes a folder of its own."""
    from mscale.data.indexed import REGENERATE
    from mscale.data.manifest import load_manifest, reprepare
    from mscale.errors import MscaleError

    if not prepared:
        return REGENERATE
    try:
        load_manifest(spec.rstrip("/"))
    except MscaleError as e:
        return e.fix or reprepare(spec.rstrip("/"))
    return reprepare(spec.rstrip("/"))


@data_app.command("verify")
def verify_cmd(
    spec: str = typer.Argument(..., help="A prepared folder (manifest.json); other sources are "
                               "checked for structure only (they carry no checksums)."),
    as_json: bool = typer.Option(False, "--json", help="Print one JSON document."),
) -> None:
    """Hash every shard's .bin and .idx against the manifest. Exit 2 names the bad shard."""
    from mscale.data.datasets import has_manifest, verify_dataset

    line = ThrottledLine("verify")

    def progress(done: int, files: int, nbytes: int, total: int) -> None:
        # a corpus of thousands of shards hashes for an hour: say what, then how far
        if not done:
            line.say(f"verify: {spec}: {files:,} file(s), {_mb(total)} of .bin, hashed "
                     "against manifest.json")
            line.restart()
        elif line.due():
            rate = nbytes / line.elapsed() / 1e6
            line.show(f"verify: {done:,} of {files:,} file(s), {_mb(nbytes)} of {_mb(total)}, "
                      f"{rate:,.0f} MB/s, {line.elapsed():.0f} s")

    try:
        problems = verify_dataset(spec, progress=progress)
    finally:
        line.close()
    # a damaged source may not open: its figures are the healthy one's alone
    d = None if problems else _describe(spec, None)
    checked = has_manifest(spec)
    if as_json:
        print_json({"spec": spec, "ok": not problems, "checksums": checked,
                    "shards": len(d["shards"]) if d else None,
                    "tokens": d["tokens"] if d else None, "problems": problems})
    elif problems:
        console.print(f"FAILED {spec}: {len(problems)} problem(s) found",
                      soft_wrap=True, markup=False)
        for p in problems:
            console.print(f"  {p}", soft_wrap=True, markup=False)
        console.print(f"  fix: {_verify_fix(spec, checked)}", soft_wrap=True, markup=False)
    else:
        how = ("every .bin and .idx matches its sha256 in the manifest" if checked else
               "structure only: without manifest.json there are no checksums")
        console.print(f"OK {spec}: {len(d['shards'])} shard(s), {d['tokens']:,} tokens; {how}",
                      soft_wrap=True, markup=False)
    if problems:
        raise typer.Exit(EXIT_CRITICAL)
