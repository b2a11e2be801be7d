"""A token source's spec → a `TokenDataset`: our manifest folder, a Megatron prefix, a flat
token file, or a folder or glob of Megatron prefixes (or of flat files), local or remote.

The shard formats themselves are `indexed.py`'s; this module decides what a spec names and opens
its shards (a few at a time: on an object store each costs round trips, and a corpus has
thousands), checking that they agree on one dtype. A glob may name Megatron prefixes without an
extension, as Megatron's ``--data-path`` does (``data/*/shard-00000``): it then matches their
``.bin`` and ``.idx`` files.
"""

from __future__ import annotations

import os
from concurrent.futures import ThreadPoolExecutor

import numpy as np

from mscale.data.indexed import Shard, TokenDataset, open_flat, open_prefix, storage_dtype
from mscale.data.manifest import (MANIFEST, TOKEN_DTYPES, check_shard, load_manifest,
                                  manifest_digest, reprepare, verify_checksums)
from mscale.data.storage import expand, join, kind, open_blob, sizes
from mscale.errors import MscaleError


def _bad(message: str, file: str, field: str | None, fix: str) -> MscaleError:
    return MscaleError(message, file=file, field=field, fix=fix)


def _open_manifest(folder: str, spec: str, dtype: np.dtype | None,
                   check_indexes: bool) -> TokenDataset:
    m = load_manifest(folder)
    url = join(folder, MANIFEST)
    if dtype is not None and dtype.itemsize != TOKEN_DTYPES[m["dtype"]].itemsize:
        raise _bad(f"the manifest says {m['dtype']}, the dtype given is {dtype}", url,
                   "manifest.dtype", "drop the dtype option; the manifest knows it")
    opener = _checked_shard if check_indexes else _listed_shard(folder)
    shards = _parallel(lambda i, s: opener(folder, m, i, s, url), list(enumerate(m["shards"])))
    ds = TokenDataset(spec, shards, vocab_size=m["vocab_size"], eod_id=m["eod_id"])
    ds.manifest_digest = manifest_digest(m)
    ds.tokenizer, ds.tokenizer_sha256 = m["tokenizer"], m.get("tokenizer_sha256")
    ds.vocab_sha256 = m.get("vocab_sha256")  # not in manifests prepared before 2026-12-08
    return ds


def _missing(s: dict, i: int, url: str, file: str) -> MscaleError:
    return _bad(f"shard {s['prefix']!r} is missing ({file})", url,
                f"manifest.shards[{i}].prefix", reprepare(url[:-len(MANIFEST) - 1]))


def _checked_shard(folder: str, m: dict, i: int, s: dict, url: str) -> Shard:
    """Shard ``i`` opened and its index parsed, both checked against the manifest."""
    try:
        shard = open_prefix(join(folder, s["prefix"]), reprepare(folder))
    except MscaleError as e:
        if e.message != "no such file":
            raise
        raise _missing(s, i, url, e.file) from None
    check_shard(m, i, url, shard.dtype, tokens=shard.tokens, documents=shard.documents,
                bin_bytes=shard.blob.size)
    return shard


def _listed_shard(folder: str):
    """An opener that takes each shard's counts from the manifest and its files' sizes from one
    listing of the folder: no index is read until the held-out cut needs its shard's. Every
    rank opens every source; reading every ``.idx`` (20 bytes a document) would have each rank
    of a large job fetch the corpus's whole index. The indexes' contents are `data verify`'s to
    check (their sha256), and the one the cut reads is parsed and checked then."""
    listed = sizes(folder)

    def open_one(folder: str, m: dict, i: int, s: dict, url: str) -> Shard:
        bin_url = join(folder, s["prefix"] + ".bin")
        for ext in ("bin", "idx"):
            if f"{s['prefix']}.{ext}" not in listed:
                raise _missing(s, i, url, join(folder, f"{s['prefix']}.{ext}"))
        dtype = storage_dtype(TOKEN_DTYPES[m["dtype"]])
        blob = open_blob(bin_url, size=listed[s["prefix"] + ".bin"])
        idx_url = join(folder, s["prefix"] + ".idx")
        shard = Shard(blob, dtype, s["documents"], lambda: open_blob(idx_url),
                      reprepare(folder))
        check_shard(m, i, url, dtype, tokens=shard.tokens, bin_bytes=blob.size)
        return shard
    return open_one


def _parallel(fn, args: list[tuple]) -> list:
    """``[fn(*a) for a in args]`` on a few threads: opening a shard on an object store costs a
    few round trips, and a corpus has thousands. The first failure (in order) is raised."""
    if len(args) < 2:
        return [fn(*a) for a in args]
    with ThreadPoolExecutor(min(16, len(args))) as pool:
        return list(pool.map(lambda a: fn(*a), args))


def _resolve(url: str, listed: set[str]) -> tuple[str, str]:
    """("prefix", PREFIX) for a Megatron .bin/.idx (or bare prefix), else ("flat", url)."""
    if url.endswith(".idx"):
        return "prefix", url[:-4]
    if url.endswith(".bin") and (url[:-4] + ".idx" in listed or kind(url[:-4] + ".idx") == "file"):
        return "prefix", url[:-4]
    return "flat", url


def _open_group(spec: str, files: list[str], dtype: np.dtype | None) -> list[Shard]:
    """A folder or glob without manifest: Megatron prefixes (or only flat files), sorted."""
    listed = set(files)
    wanted = [f for f in files if f.endswith((".bin", ".idx"))]
    if not wanted:
        raise _bad("no .bin or .idx file here", spec, "spec",
                   "name a folder with manifest.json, Megatron .bin/.idx pairs, or flat .bin files")
    resolved = list(dict.fromkeys(_resolve(f, listed) for f in wanted))  # sorted, deduplicated
    kinds = {k for k, _ in resolved}
    if kinds == {"prefix", "flat"}:
        flat = next(u for k, u in resolved if k == "flat")
        raise _bad(f"mixes Megatron prefixes with a flat token file ({flat} has no .idx)", spec,
                   "spec", "name the Megatron prefixes and the flat files as separate sources")
    if kinds == {"flat"}:
        return _parallel(open_flat, [(u, dtype or TOKEN_DTYPES["uint16"]) for _, u in resolved])
    return _parallel(open_prefix, [(p,) for _, p in resolved])


def open_dataset(spec: str, *, dtype: str | None = None, flat_only: bool = False,
                 check_indexes: bool = False) -> TokenDataset:
    """Open a token source: a manifest folder, a Megatron prefix (or its .bin/.idx), a flat token
    file (``dtype``, default uint16), or a folder/glob of Megatron prefixes, local or remote.

    ``dtype`` given for one source (``data inspect --dtype``) must agree with what a manifest or
    an index records. ``flat_only``: it is a blend's one ``data.dtype``, which speaks for its
    flat files and is no claim about the sources that record their own: a blend of a uint32
    flat file and a uint16 prepared folder is fine.

    ``check_indexes``: parse a prepared folder's every ``.idx`` against its ``.bin`` and the
    manifest (`data verify`). Without it such a folder is opened from its manifest and one
    listing (`_listed_shard`); a Megatron prefix or glob is always parsed (it has no manifest:
    its indexes are where its document counts are)."""
    want = None if dtype is None else np.dtype(dtype)
    if want is not None and want.kind not in "iu":
        raise _bad(f"token dtype {want} is not an integer type", spec, "dtype",
                   "use uint16 or uint32")
    what = "glob" if any(c in spec for c in "*?[") else kind(spec)
    if what == "dir" and kind(join(spec, MANIFEST)) == "file":
        return _open_manifest(spec.rstrip("/"), spec, None if flat_only else want, check_indexes)
    if what == "glob":
        shards = _open_group(spec, _glob(spec), want)
    elif what == "dir":
        shards = _open_group(spec, expand(spec), want)
    elif what == "file":
        k, url = _resolve(spec, set())
        if k == "flat":
            _refuse_text(spec)
        flat = want or TOKEN_DTYPES["uint16"]
        shards = [open_prefix(url) if k == "prefix" else open_flat(url, flat)]
    elif kind(spec + ".idx") == "file":
        shards = [open_prefix(spec)]
    else:
        raise SourceNotFound.of(spec)
    return _checked(spec, shards, None if flat_only else want)


class SourceNotFound(MscaleError):
    """A spec that names nothing. ``relative``: a local relative path, which is taken from the
    current directory, not from the plan's or the command's: the usual cause when the same
    command works from another directory, so the message names the directory it was taken
    from."""

    relative: bool = False

    @classmethod
    def of(cls, spec: str) -> "SourceNotFound":
        what = "no such file, folder or Megatron prefix (PREFIX.bin + PREFIX.idx)"
        local = "://" not in spec and "::" not in spec
        if not local or os.path.isabs(os.path.expanduser(spec)):
            return cls(what, file=spec, fix="check the path")
        e = cls(f"{what}; a relative path is taken from the current directory "
                f"({os.getcwd()}): {os.path.abspath(spec)}", file=spec,
                fix="run from the directory the path is relative to, or give an absolute path")
        e.relative = True
        return e


TEXT_SUFFIXES = (".json", ".jsonl", ".yaml", ".yml", ".txt", ".md", ".py", ".csv", ".parquet",
                 ".zst", ".gz", ".html")
"""Names no flat token file has: a flat file is raw integers (``.bin`` or no suffix), so one of
these given as a source is a mistake (a tokenizer, a plan, the text before `prepare`), which
read as tokens gave a count and an entropy of bytes that are not tokens."""


def _refuse_text(spec: str) -> None:
    name = spec.rstrip("/").rsplit("/", 1)[-1]
    if name == MANIFEST:
        folder = spec.rstrip("/").rsplit("/", 1)[0] if "/" in spec.rstrip("/") else "."
        raise _bad("is a prepared folder's manifest, not token data", spec, "spec",
                   f"name the folder: {folder}")
    if name.lower().endswith(TEXT_SUFFIXES):
        raise _bad(f"a {name.rsplit('.', 1)[-1]} file is not token data (a flat token file is "
                   "raw integers, .bin or no suffix)", spec, "spec",
                   "tokenize text first (mscale data prepare FILES --tokenizer T --out DIR), "
                   "then name DIR")


def _glob(spec: str) -> list[str]:
    """A glob's files; a glob that matches none but whose ``.bin``/``.idx`` do names Megatron
    prefixes (module docstring)."""
    try:
        return expand(spec)
    except MscaleError as none:
        found = []
        for ext in (".bin", ".idx"):
            try:
                found += expand(spec + ext)
            except MscaleError:
                continue
        if not found:
            raise none from None
        return sorted(found)


def _checked(spec: str, shards: list[Shard], want: np.dtype | None) -> TokenDataset:
    """One dtype across all shards, and the one asked for if any."""
    first = shards[0]
    for s in shards:
        if s.dtype != first.dtype:
            raise _bad(f"stores {s.dtype}, but {first.blob.url} stores {first.dtype}", s.blob.url,
                       "idx.dtype", "tokenize every shard of one source with one dtype")
        if want is not None and s.documents is not None and s.dtype.itemsize != want.itemsize:
            raise _bad(f"the index says {s.dtype}, the dtype given is {want}", s.blob.url,
                       "idx.dtype", "drop the dtype option; a Megatron index knows its dtype")
    return TokenDataset(spec, shards)


def uint32_read_as_uint16(ds: TokenDataset, head: np.ndarray | None = None) -> str | None:
    """Why a flat file read as uint16 holds uint32 ids, or None: such a file of ids below
    65,536 read so is every id followed by a 0 (its high half), ids all below any vocabulary,
    so only this pattern gives it away; in real uint16 tokens every second id 0 over hundreds
    of them does not happen. ``head``: the first MiB of tokens, when the caller has read it.
    The one rule for training's refusal (`blend.check_vocab`) and `data inspect`'s warning;
    the caller asks only when the dtype was not said."""
    if ds.documents is not None or ds.dtype != np.uint16 or ds.num_tokens % 2:
        return None
    if head is None:
        head = ds.read(0, min(ds.num_tokens, 1 << 20))
    if head.size < 256 or head[1::2].any() or not head[0::2].any():
        return None
    return f"every second of its first {head.size:,} ids is 0: it holds uint32 ids"


def verify_dataset(spec: str, chunk_bytes: int = 8 << 20, progress=None) -> list[str]:
    """Problems found in a source that exists: each shard's .bin and .idx hashed against the
    manifest's sha256 (a missing one named), then the structure checked by opening it. A source
    without our manifest has no checksums: opening it is the whole check.

    A damaged source is a failed check (problems: ``data verify`` exits 2), not bad input; what
    holds no token data at all (an empty folder, a path that names nothing, a file of another
    kind) raises, as at open (exit 3). ``progress``: `manifest.verify_checksums`'s."""
    manifest = has_manifest(spec)
    problems: list[str] = []
    missing: list[str] = []
    try:
        if manifest:  # the manifest promises its files: anything wrong with them is damage
            problems += verify_checksums(spec.rstrip("/"), chunk_bytes, missing, progress)
        if not missing:
            # a checksum says a file changed; the structure says how (a truncated .bin: its
            # size against the index), so it is checked too unless a file is missing
            open_dataset(spec, check_indexes=True)
    except MscaleError as e:
        if not (manifest or _damaged_megatron_file(e)):
            raise  # an empty folder, a file that holds no tokens, a path that names nothing
        where = ": ".join(x for x in (e.file, e.field) if x)
        problems.append(f"{where}: {e.message}" if where else e.message)
    return problems


def has_manifest(spec: str) -> bool:
    return kind(spec) == "dir" and kind(join(spec, MANIFEST)) == "file"


def _damaged_megatron_file(e: MscaleError) -> bool:
    """A Megatron .idx or .bin that opened but does not hold together (indexed.py's checks,
    named ``idx.*``/``bin.*``): damage, where a flat file of odd size may be no token file."""
    return bool(e.field) and e.field.startswith(("idx.", "bin."))

