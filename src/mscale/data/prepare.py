"""`mscale data prepare`: text corpora → token shards (Megatron MMIDIDX) and a manifest.

What it reads (.txt, .jsonl, .parquet, compressed or not; files, folders, globs, URLs) and in
which order is `mscale.data.corpus` (docs/data.md).

How: the main process reads documents in input order, cuts them into batches and hands them to
`mscale.data.encode.Encoder` (``workers`` processes, or one daemon thread), which appends the
end-of-document id to every document and hands the results back in submission order; the main
process writes the shards with `IndexedWriter`. The output is therefore byte-identical whatever
the worker count. While it waits for a batch (one .txt file is one document, and one large
document takes minutes) it keeps reporting what is being tokenized.

Atomic as a whole: everything is written into ``OUT.tmp-<pid>`` beside OUT and renamed to OUT
at the end; a failure removes the temporary folder. An existing OUT is refused unless ``force``,
which replaces it only once the new folder is complete (and only if it is a token folder or
empty: never a folder of something else).
"""

from __future__ import annotations

import json
import os
import shutil
from dataclasses import dataclass
from typing import Callable, Iterable, Iterator

import numpy as np
from fsspec.implementations.local import LocalFileSystem

from mscale.data.corpus import Skipped, expand_inputs, input_size, iter_documents
from mscale.data.encode import Encoder, default_workers
from mscale.data.indexed import IndexedWriter
from mscale.data.manifest import FORMAT, MANIFEST, VERSION
from mscale.data.storage import check_parents, fsync_dir
from mscale.data.tokenizer import eod_id, read_tokenizer, vocab_of, vocab_sha256
from mscale.errors import MscaleError
from mscale.urls import fs_and_path

SHARD_TOKENS = 1 << 28
"""Tokens per shard (268M: 512 MiB at uint16, 1 GiB at uint32). A 1T-token corpus is ~4,000
shards, not millions of files; one shard hashes in about a second, so `verify` names a bad unit
small enough to re-create; and object stores move files of this size at full speed, in parallel."""
BATCH_DOCS = 512
BATCH_BYTES = 1 << 20
"""A batch sent to a worker: at most this many documents or bytes of text, ~0.1–1 s of encoding.
Batches are cut by the input alone, never by the worker count."""

Progress = Callable[[int, int, int, int], None]
"""Called after every batch written, and every `encode.WAIT_S` while waiting for one: (documents,
tokens, bytes of input written, bytes of input being tokenized)."""


# --- tokenizing -----------------------------------------------------------------------------

@dataclass
class _Batch:
    texts: list[str]
    nbytes: int
    empty: int


def _batches(docs: Iterator[tuple[str, int]]) -> Iterator[_Batch]:
    texts: list[str] = []
    nbytes = size = empty = 0
    for text, n in docs:
        nbytes += n
        if not text:
            empty += text is not None
            continue
        texts.append(text)
        size += len(text)
        if len(texts) >= BATCH_DOCS or size >= BATCH_BYTES:
            yield _Batch(texts, nbytes, empty)
            texts, nbytes, size, empty = [], 0, 0, 0
    if texts or nbytes or empty:
        yield _Batch(texts, nbytes, empty)


# --- output ---------------------------------------------------------------------------------

def _check_out(out: str, force: bool) -> str:
    """The local folder to create; an existing one only with ``force`` and only if it is a token
    folder (or empty): --force never deletes a folder of something else. A URL is refused by
    its scheme, before fsspec loads the store's driver: without s3fs installed an ``s3://``
    --out said "install s3fs", which would only have led to this refusal."""
    remote = ("://" in str(out) and "::" not in str(out)  # a chain: urls.py says why not
              and not str(out).startswith("file://"))
    fs, path = (None, None) if remote else fs_and_path(out)
    if remote or not isinstance(fs, LocalFileSystem):
        raise MscaleError("token shards are written to a local folder", file=str(out),
                          field="--out",
                          fix="write them locally, then copy the folder to the store")
    path = os.path.abspath(os.path.expanduser(str(out)[len("file://"):] if str(out).startswith(
        "file://") else str(out)))
    if os.path.lexists(path):
        if not force:
            raise MscaleError("the output folder already exists", file=str(out), field="--out",
                              fix="choose a new --out, or pass --force to replace it (once the "
                                  "new one is complete)")
        if not os.path.isdir(path) or os.path.islink(path):
            raise MscaleError("exists and is not a folder; --force replaces only a token folder",
                              file=str(out), field="--out", fix="choose another --out")
        if os.listdir(path) and not _is_token_folder(path):
            raise MscaleError("exists and is not a token folder (no mscale-tokens manifest.json); "
                              "--force will not delete it", file=str(out), field="--out",
                              fix="choose another --out, or remove the folder yourself")
    else:
        check_parents(path, str(out), "--out")
    return path


def _is_token_folder(path: str) -> bool:
    try:
        with open(os.path.join(path, MANIFEST), encoding="utf-8") as f:
            return json.load(f).get("format") == FORMAT
    except (OSError, ValueError, AttributeError):
        return False


def _commit(tmp: str, path: str) -> None:
    """Put the finished folder in place; an old one (``force``) is moved aside first and removed
    only after the rename, so OUT is always the old or the new folder, whole."""
    old = None
    if os.path.lexists(path):
        old = f"{path}.old-{os.getpid()}"
        os.rename(path, old)
    try:
        os.rename(tmp, path)
    except BaseException:
        if old is not None:
            os.rename(old, path)
        raise
    fsync_dir(os.path.dirname(path))
    if old is not None:
        shutil.rmtree(old, ignore_errors=True)


def _write_json(path: str, obj: dict) -> None:
    with open(path, "w", encoding="utf-8") as f:
        f.write(json.dumps(obj, indent=2) + "\n")
        f.flush()
        os.fsync(f.fileno())


# --- the whole -----------------------------------------------------------------------------

def prepare(inputs: list[str], tokenizer: str, out: str, *, text_field: str = "text",
            column: str = "text", workers: int | None = None, shard_tokens: int = SHARD_TOKENS,
            eod: str | None = None, text_exts: Iterable[str] = (), force: bool = False,
            progress: Progress | None = None,
            on_start: Callable[[dict], None] | None = None,
            on_skip: Callable[[MscaleError], None] | None = None) -> dict:
    """Tokenize ``inputs`` with ``tokenizer`` into shards under ``out``; returns the manifest.

    ``on_start`` gets what was resolved before any work (files, bytes, workers, vocabulary, EOD,
    dtype); ``progress`` (`Progress`) after every batch written and every second or so while one
    is being tokenized. ``on_skip`` (``--skip-bad``):
    unreadable records and files are skipped, each handed to it and listed in the manifest
    (``skipped``, the first `corpus.SKIPPED_LISTED`; ``skipped_count``), instead of stopping
    the run.
    """
    if shard_tokens < 1:
        raise MscaleError(f"--shard-tokens {shard_tokens} must be at least 1",
                          field="--shard-tokens", fix=f"e.g. --shard-tokens {SHARD_TOKENS}")
    if workers is not None and workers < 1:
        raise MscaleError(f"--workers {workers} must be at least 1", field="--workers",
                          fix="pass 1 or more, or leave it out for one per CPU")
    path = _check_out(out, force)
    tok_path, tok_json, tok_sha = read_tokenizer(tokenizer)
    from tokenizers import Tokenizer

    tok = Tokenizer.from_str(tok_json)
    eod = eod_id(tok, eod, file=tok_path)
    vocab = vocab_of(tok)
    dtype = "uint16" if vocab <= 1 << 16 else "uint32"
    sources = expand_inputs(inputs, text_exts=text_exts)
    workers = workers or default_workers()
    if on_start is not None:
        on_start({**input_size(sources), "workers": workers, "tokenizer": tok_path,
                  "vocab_size": vocab, "eod_id": eod, "eod_token": tok.id_to_token(eod),
                  "dtype": dtype, "out": path})

    tmp = f"{path}.tmp-{os.getpid()}"
    shutil.rmtree(tmp, ignore_errors=True)  # ours from an earlier call in this process
    os.makedirs(tmp)
    skipped = Skipped(on_skip) if on_skip is not None else None
    try:
        docs = iter_documents(sources, text_field=text_field, column=column, on_bad=skipped)
        shards, documents, tokens, empty = _write_shards(docs, tmp, workers, tok_json, eod, dtype,
                                                         shard_tokens, progress)
        if documents == 0:
            raise MscaleError(f"empty corpus: {len(sources)} file(s), no document with text"
                              + (f" ({empty} empty)" if empty else ""), file=", ".join(inputs),
                              field="INPUT", fix="check the inputs (and --text-field / --column)")
        manifest = {"format": FORMAT, "version": VERSION, "tokenizer": str(tokenizer),
                    "tokenizer_sha256": tok_sha, "vocab_sha256": vocab_sha256(tok),
                    "vocab_size": vocab, "eod_id": eod,
                    "dtype": dtype, "tokens": tokens, "documents": documents,
                    "inputs": [str(i) for i in inputs], "files": len(sources),
                    "empty_documents_skipped": empty, "shards": shards}
        if skipped is not None:
            manifest.update(skipped.record())
        _write_json(os.path.join(tmp, MANIFEST), manifest)
        fsync_dir(tmp)
        _commit(tmp, path)
    except BaseException:
        shutil.rmtree(tmp, ignore_errors=True)
        raise
    return manifest


def _write_shards(docs, tmp: str, workers: int, tok_json: str, eod: int, dtype: str,
                  shard_tokens: int, progress: Progress | None):
    """Write the documents into shard-00000, ... under ``tmp``; a shard holds at most
    ``shard_tokens`` tokens unless one document alone is longer (documents never span shards)."""
    shards: list[dict] = []
    documents = tokens = nbytes = empty = 0
    writer: IndexedWriter | None = None
    in_shard = 0
    encoder = Encoder(workers, tok_json, eod, dtype)

    def report() -> None:
        if progress is not None:
            progress(documents, tokens, nbytes, encoder.pending_bytes)

    try:
        for batch, flat, lengths in encoder.map(_batches(docs), on_wait=report):
            offsets = np.zeros(len(lengths) + 1, dtype=np.int64)
            np.cumsum(lengths, out=offsets[1:])
            for first, stop, roll in _runs(lengths.tolist(), in_shard, shard_tokens):
                if roll and writer is not None:
                    shards.append(_shard_entry(writer.close()))
                    writer = None
                if writer is None:
                    writer = IndexedWriter(os.path.join(tmp, f"shard-{len(shards):05d}"), dtype)
                    in_shard = 0
                a, b = int(offsets[first]), int(offsets[stop])
                writer.add_documents(flat[a:b], lengths[first:stop])
                in_shard += b - a
            documents += len(lengths)
            tokens += int(flat.size)
            nbytes += batch.nbytes
            empty += batch.empty
            report()
        if writer is not None:
            shards.append(_shard_entry(writer.close()))
            writer = None
    except BaseException:
        encoder.abort()  # Ctrl-C, a bad record: the workers stop now, not after their batches
        raise
    else:
        encoder.close()
    finally:
        if writer is not None:
            writer.abort()
    return shards, documents, tokens, empty


def _runs(lengths: list[int], in_shard: int,
          shard_tokens: int) -> Iterator[tuple[int, int, bool]]:
    """A batch's documents as runs ``[first, stop)`` that each go into one shard, with whether the
    run starts a new shard. ``in_shard``: tokens already in the open shard. A document that would
    take a non-empty shard past ``shard_tokens`` starts the next one, so a longer document sits
    alone and no document spans shards."""
    first, roll = 0, False
    for i, n in enumerate(lengths):
        if in_shard and in_shard + n > shard_tokens:
            if i > first:
                yield first, i, roll
            first, roll, in_shard = i, True, 0
        in_shard += n
    if len(lengths) > first:
        yield first, len(lengths), roll


def _shard_entry(info: dict) -> dict:
    return {k: info[k] for k in ("prefix", "tokens", "documents", "bin_bytes", "bin_sha256",
                                 "idx_sha256")}
