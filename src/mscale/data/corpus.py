"""The documents of a text corpus, in input order: what `mscale data prepare` and
`mscale data tokenizer` read (docs/data.md).

- ``.txt`` (and the extensions given as ``text_exts``, e.g. ``.py``): one document per file. A
  file is the natural unit of a book, an article or a source file; splitting on blank lines would
  cut documents at every paragraph. Corpora with many documents per file come as ``.jsonl``.
- ``.jsonl`` / ``.ndjson``: one document per line, the string field ``text_field``.
- ``.parquet``: one document per row, the string column ``column`` (needs pyarrow).
- each of them ``.gz`` / ``.zst`` / ``.bz2`` / ``.xz`` compressed (not parquet, which compresses
  inside); files, folders (recursive, by extension, hidden files skipped), globs; local paths or
  fsspec URLs. A file named twice is read once. Empty documents are yielded (as "") for the
  caller to count and skip.

Text must be UTF-8: anything else is refused naming the file, the line and the byte offset.
"""

from __future__ import annotations

import dataclasses
import json
import os
import re
import shlex
from dataclasses import dataclass
from typing import Callable, Iterable, Iterator

from fsspec.implementations.local import LocalFileSystem

from mscale.data.compressed import open_compressed
from mscale.errors import MscaleError
from mscale.urls import fs_and_path

TEXT_EXTS = (".txt",)
JSONL_EXTS = (".jsonl", ".ndjson")
PARQUET_EXTS = (".parquet",)
COMPRESSIONS = {".gz": "gzip", ".zst": "zstd", ".bz2": "bz2", ".xz": "xz"}
_GLOB = re.compile(r"[*?\[]")
_SURROGATE_ESCAPE = re.compile(rb"\\u[dD][89a-fA-F]")


@dataclass(frozen=True)
class Source:
    """One input file: its URL (local path or fsspec URL), how it is read, its size on disk."""

    url: str
    kind: str  # "text" | "jsonl" | "parquet"
    compression: str | None
    size: int


# --- inputs ---------------------------------------------------------------------------------

def _exts(text_exts: Iterable[str]) -> tuple[str, ...]:
    out = list(TEXT_EXTS)
    for e in text_exts:
        e = e.strip().lower()
        if not e:
            continue
        e = e if e.startswith(".") else "." + e
        if e in JSONL_EXTS + PARQUET_EXTS or e in COMPRESSIONS:
            raise MscaleError(f"{e} cannot be read as plain text", field="--text-ext",
                              fix="--text-ext names extra plain-text extensions, e.g. .py or .md")
        out.append(e)
    return tuple(out)


def classify(name: str, text_exts: tuple[str, ...] = TEXT_EXTS) -> tuple[str, str | None] | None:
    """(kind, compression) of a file name by its extension; None when it is not read."""
    low = name.lower()
    compression = None
    for ext, comp in COMPRESSIONS.items():
        if low.endswith(ext):
            low, compression = low[: -len(ext)], comp
            break
    if low.endswith(JSONL_EXTS):
        return "jsonl", compression
    if low.endswith(PARQUET_EXTS):
        return ("parquet", None) if compression is None else None
    if low.endswith(text_exts):
        return "text", compression
    return None


def _url(fs, path: str) -> str:
    return path if isinstance(fs, LocalFileSystem) else fs.unstrip_protocol(path)


TOKEN_EXTS = (".bin", ".idx")


def _is_tokens(name: str) -> bool:
    return os.path.splitext(name)[1].lower() in TOKEN_EXTS


def _token_data(spec: str, found: str, source: str) -> MscaleError:
    """Token files given to prepare (Megatron's .bin/.idx, a flat .bin): already tokenized. The
    --text-ext the other errors suggest would read their bytes as text; training reads them
    as they are, named as ``source``."""
    what = "token data" if found == spec else f"{found} is token data"
    return MscaleError(f"{what} (a Megatron-LM .bin/.idx pair or a flat token file), not text: "
                       "prepare and tokenizer read text", file=spec, field="INPUT",
                       fix=f"train on it as it is (training.data.path: {source}; `mscale data "
                           f"inspect {shlex.quote(source)}` shows what it holds), or prepare the "
                           "text it was "
                           "made from")


def _token_file(fs, path: str, spec: str) -> MscaleError:
    """``spec``, a file named .bin or .idx: a Megatron prefix when both halves are there."""
    stem = os.path.splitext(path)[0]
    pair = all(fs.isfile(stem + e) for e in TOKEN_EXTS)
    return _token_data(spec, spec, os.path.splitext(spec)[0] if pair else spec)


def _unknown(url: str, exts: tuple[str, ...]) -> MscaleError:
    if re.search(r"\.parquet\.(gz|zst|bz2|xz)$", url.lower()):
        return MscaleError("a compressed .parquet is not read (parquet compresses inside)",
                           file=url, fix="decompress it, or write it with parquet compression")
    known = ", ".join(exts + JSONL_EXTS + PARQUET_EXTS)
    return MscaleError("unknown file type (by its extension)", file=url,
                       fix=f"pass {known} (optionally .gz/.zst/.bz2/.xz), or --text-ext EXT to "
                           "read this extension as plain text, one document per file")


def _nothing_matches(spec: str, files: list[str], exts: tuple[str, ...]) -> MscaleError:
    """A glob without a readable match: none at all (a typo, a pattern the shell expanded), or
    files of types not read here, whose extensions are named with the --text-ext that reads
    them (as for a folder of them)."""
    tokens = [f for f in files if _is_tokens(f)]
    if tokens:  # a glob of Megatron prefixes, as training names one
        return _token_data(spec, tokens[0], spec)
    if not files:
        return MscaleError("no file matches this pattern", file=spec, field="INPUT",
                           fix="check the pattern (quote it so the shell does not expand it)")
    found = sorted({os.path.splitext(f.rsplit("/", 1)[-1])[1].lower() or "no extension"
                    for f in files})
    example = next((e for e in found if e.startswith(".")), ".EXT")
    return MscaleError(f"{len(files):,} file(s) match, none of a type read here "
                       f"({', '.join(found)})", file=spec, field="INPUT",
                       fix=f"pass --text-ext {example} to read them as plain text, one document "
                           f"per file, or match {', '.join(exts + JSONL_EXTS + PARQUET_EXTS)} "
                           "files")


def expand_inputs(inputs: Iterable[str], *, text_exts: Iterable[str] = ()) -> list[Source]:
    """Every file the inputs name, in order: a file as given, a folder's matching files
    (recursive, sorted, hidden ones skipped), a glob's matches (sorted). Duplicates read once."""
    exts = _exts(text_exts)
    out: list[Source] = []
    seen: set[str] = set()
    inputs = list(inputs)
    if not inputs:
        raise MscaleError("no inputs given", field="INPUT",
                          fix="name files, folders or globs of .txt, .jsonl or .parquet")
    for spec in inputs:
        fs, path = fs_and_path(spec)
        found: list[tuple[str, str, int]] = []  # (identity, URL shown and opened, size)
        try:
            if fs.isfile(path):
                url = _url(fs, path) if "://" in str(spec) else str(spec)
                if classify(url, exts) is None:
                    if _is_tokens(path):
                        raise _token_file(fs, path, str(spec))
                    raise _unknown(str(spec), exts)
                found = [(fs.unstrip_protocol(path), url, fs.size(path))]
            elif fs.isdir(path):
                for p, info in sorted(fs.find(path, detail=True).items()):
                    local = isinstance(fs, LocalFileSystem)
                    rel = os.path.relpath(p, path) if local else p[len(path):]
                    if any(part.startswith(".") for part in rel.split("/")):
                        continue
                    if classify(p, exts) is not None:
                        found.append((fs.unstrip_protocol(p), _url(fs, p),
                                      info.get("size") or 0))
                if not found:
                    tokens = [p for p in fs.find(path) if _is_tokens(p)]
                    if tokens:  # a folder of Megatron prefixes, as training names one
                        raise _token_data(str(spec), _url(fs, tokens[0]), str(spec))
                    raise MscaleError("this folder holds no file of a type read here",
                                      file=str(spec), field="INPUT",
                                      fix=f"put {', '.join(exts + JSONL_EXTS + PARQUET_EXTS)} "
                                          "files in it, or --text-ext EXT for other text files")
            elif _GLOB.search(path):
                files = [p for p in sorted(fs.glob(path)) if fs.isfile(p)]
                for p in files:
                    if classify(p, exts) is not None:
                        found.append((fs.unstrip_protocol(p), _url(fs, p), fs.size(p)))
                if not found:
                    raise _nothing_matches(str(spec), files, exts)
            else:
                if all(fs.isfile(path + e) for e in TOKEN_EXTS):  # a Megatron prefix
                    raise _token_data(str(spec), f"{spec}.bin", str(spec))
                raise MscaleError("input not found", file=str(spec), field="INPUT",
                                  fix="check the path (a file, a folder or a glob)")
        except (PermissionError, NotADirectoryError) as e:
            raise MscaleError(f"cannot read this input ({e.strerror or e})", file=str(spec),
                              field="INPUT", fix="check the path and its permissions") from None
        for key, url, size in found:
            if key not in seen:  # the same file by two names (a.txt, ./a.txt, its folder)
                seen.add(key)
                kind, comp = classify(url, exts)
                out.append(Source(url, kind, comp, int(size)))
    return out


# --- documents ------------------------------------------------------------------------------

def input_size(sources: list[Source]) -> dict:
    """What a start line says of the input: files, bytes on disk, and whether those bytes are
    what the reader counts as read (not for parquet or compressed files), so that a progress
    line may show a share of them."""
    return {"files": len(sources), "bytes": sum(s.size for s in sources),
            "bytes_known": all(s.kind != "parquet" and not s.compression for s in sources)}


def _decode(raw: bytes, url: str, offset: int, line: int | None = None) -> str:
    try:
        return raw.decode("utf-8")
    except UnicodeDecodeError as e:
        at = f"line {line}, " if line is not None else ""
        raise MscaleError(f"not UTF-8: {at}byte offset {offset + e.start} "
                          f"(0x{raw[e.start]:02x})", file=url,
                          fix="convert the file to UTF-8 (e.g. iconv -f latin1 -t utf-8)") from None


def _open(src: Source):
    fs, path = fs_and_path(src.url)
    try:  # a truncated compressed file is a named error, not a shorter corpus
        return open_compressed(fs, path, src.url, src.compression)
    except FileNotFoundError:
        raise MscaleError("input disappeared while being read", file=src.url,
                          fix="rerun once the input is stable") from None


def _read_text(src: Source) -> Iterator[tuple[str, int]]:
    with _open(src) as f:
        raw = f.read()
    text = _decode(raw, src.url, 0)
    if text.startswith("\ufeff"):
        text = text[1:]
    yield text, len(raw)


def _lines(f, chunk: int = 1 << 20) -> Iterator[bytes]:
    """The lines of a binary stream, each with its newline (the last may lack one): by chunks,
    since not every decompressing stream (zstd's) has readline."""
    rest = b""
    while True:
        block = f.read(chunk)
        if not block:
            break
        lines = (rest + block).split(b"\n")
        rest = lines.pop()
        for line in lines:
            yield line + b"\n"
    if rest:
        yield rest


def _read_jsonl(src: Source, field: str, on_bad=None) -> Iterator[tuple[str, int]]:
    offset = 0
    with _open(src) as f:
        for lineno, raw in enumerate(_lines(f), 1):
            start, offset = offset, offset + len(raw)
            if not raw.strip():
                yield None, len(raw)  # a blank line: no document
                continue
            try:
                text = _jsonl_text(raw, f"{src.url}:{lineno}", src.url, start, lineno, field)
            except MscaleError as e:
                if on_bad is None:
                    raise
                on_bad(e)
                yield None, len(raw)  # a skipped line: no document, its bytes read
                continue
            yield text, len(raw)


def _jsonl_text(raw: bytes, where: str, url: str, start: int, lineno: int, field: str) -> str:
    """The text of one .jsonl line; MscaleError naming the line when it has none."""
    try:
        obj = json.loads(_decode(raw, url, start, lineno))
    except json.JSONDecodeError as e:
        raise MscaleError(f"not JSON ({e.msg}, column {e.colno})", file=where,
                          fix="each line of a .jsonl file must be one JSON object") from None
    if not isinstance(obj, dict):
        raise MscaleError(f"a JSON {type(obj).__name__}, not an object", file=where,
                          fix="each line of a .jsonl file must be one JSON object")
    if field not in obj:
        keys = ", ".join(list(obj)[:10]) or "none"
        raise MscaleError(f"no field {field!r} (its fields: {keys})", file=where,
                          field=field, fix="name the text field with --text-field")
    text = obj[field]
    if text is None:
        text = ""
    if not isinstance(text, str):
        raise MscaleError(f"field {field!r} is a {type(text).__name__}, not a string",
                          file=where, field=field, fix="name the text field with --text-field")
    if _SURROGATE_ESCAPE.search(raw):
        try:
            text.encode("utf-8")
        except UnicodeEncodeError:
            raise MscaleError("a lone UTF-16 surrogate escape (\\ud800-\\udfff) is not "
                              "text", file=where, field=field,
                              fix="repair or drop this line") from None
    return text


def _pyarrow(url: str):
    try:
        import pyarrow as pa
        import pyarrow.parquet as pq
    except ImportError:
        raise MscaleError("reading .parquet needs pyarrow, which is not installed", file=url,
                          fix="install pyarrow (pip install pyarrow), or convert to .jsonl"
                          ) from None
    return pa, pq


def _read_parquet(src: Source, column: str) -> Iterator[tuple[str, int]]:
    pa, pq = _pyarrow(src.url)
    with _open(src) as f:
        try:
            pf = pq.ParquetFile(f)
        except (pa.ArrowException, OSError) as e:
            raise MscaleError(f"not a readable parquet file ({' '.join(str(e).split())[:200]})",
                              file=src.url, fix="check the file (was it cut short?)") from None
        schema = pf.schema_arrow
        if column not in schema.names:
            raise MscaleError(f"no column {column!r} (its columns: "
                              f"{', '.join(schema.names[:10])})", file=src.url, field=column,
                              fix="name the text column with --column")
        typ = schema.field(column).type
        if not (pa.types.is_string(typ) or pa.types.is_large_string(typ)
                or getattr(pa.types, "is_string_view", lambda t: False)(typ)):
            raise MscaleError(f"column {column!r} is {typ}, not a string column", file=src.url,
                              field=column, fix="name the text column with --column")
        for batch in pf.iter_batches(columns=[column], batch_size=4096):
            col = batch.column(0)
            first = True
            for text in col.to_pylist():
                yield (text or ""), (col.nbytes if first else 0)
                first = False


def iter_documents(sources: list[Source], *, text_field: str = "text", column: str = "text",
                   on_bad: Callable[[MscaleError], None] | None = None
                   ) -> Iterator[tuple[str | None, int]]:
    """(text, bytes read) of every document, in input order: empty documents included (as "")
    so that callers count them, blank .jsonl lines as None (no document, bytes only).

    ``on_bad``: an unreadable record (a .jsonl line) or file (a .txt that is not UTF-8, a
    .parquet without the text column) is handed to it and skipped, where by default its
    MscaleError stops the read, its fix naming ``--skip-bad`` (a corpus scraped from many places
    has a few). A file that fails part-way keeps the documents read before the failure. A
    missing pyarrow is never skipped (it would skip every .parquet file): it is checked first."""
    if any(src.kind == "parquet" for src in sources):
        _pyarrow(next(src.url for src in sources if src.kind == "parquet"))
    for src in sources:
        try:
            if src.kind == "text":
                yield from _read_text(src)
            elif src.kind == "jsonl":
                yield from _read_jsonl(src, text_field, on_bad)
            else:
                yield from _read_parquet(src, column)
        except MscaleError as e:
            if on_bad is None:
                raise _suggest_skip(e) from None
            on_bad(e)


def _suggest_skip(e: MscaleError) -> MscaleError:
    """``e`` with its fix naming --skip-bad too: a skippable error is the one place a user
    learns the option exists."""
    hint = f"pass {SKIP_FLAG} to skip what cannot be read and go on"
    return dataclasses.replace(e, fix=f"{e.fix}; or {hint}" if e.fix else hint)


SKIP_FLAG = "--skip-bad"
"""The option of `mscale data prepare` and `mscale data tokenizer` that passes ``on_bad``."""
SKIPPED_LISTED = 1000
"""Skipped records a manifest or a JSON report names (``skipped_count`` counts them all)."""


class Skipped:
    """What ``--skip-bad`` skipped: an ``on_bad`` that counts every error, keeps the first
    SKIPPED_LISTED (a corpus where every line is bad must not hold millions of them) and hands
    each to ``report`` (the command's ``skipped FILE:LINE: why`` lines)."""

    def __init__(self, report: Callable[[MscaleError], None] | None = None) -> None:
        self.report = report
        self.count = 0
        self.listed: list[dict] = []

    def __call__(self, e: MscaleError) -> None:
        self.count += 1
        if len(self.listed) < SKIPPED_LISTED:
            self.listed.append({"where": e.file, "why": e.message})
        if self.report is not None:
            self.report(e)

    def record(self) -> dict:
        """The ``skipped_count`` and ``skipped`` fields of a manifest or a JSON report."""
        return {"skipped_count": self.count, "skipped": list(self.listed)}
