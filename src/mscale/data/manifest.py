"""Our ``manifest.json``: what a token folder written by `mscale data prepare` holds, checked.

The one definition of the format for both sides: `prepare` writes it (`FORMAT`, `VERSION`,
`MANIFEST`), `indexed.open_dataset` reads it (`load_manifest`, then `check_shard` for every shard
it opens), `indexed.verify_dataset` hashes the shards against it (`verify_checksums`). It knows
entries and files by name and size only, never the MMIDIDX layout, so it imports storage and not
indexed: indexed imports it, without a cycle.

A manifest names its shards by bare file names inside its folder; a name that could leave the
folder (``..``, an absolute path, a separator) is refused. Checksums are not computed at open
(hours for terabytes); `verify_checksums` computes them on request.
"""

from __future__ import annotations

import hashlib
import json
from typing import Callable

import numpy as np

from mscale.data.storage import join, kind, open_blob, sha256
from mscale.errors import MscaleError

FORMAT = "mscale-tokens"
VERSION = 1
MANIFEST = "manifest.json"
TOKEN_DTYPES = {"uint16": np.dtype(np.uint16), "uint32": np.dtype(np.uint32)}
"""Flat-file and manifest token dtypes."""


def reprepare(folder: str) -> str:
    """The fix for a manifest, or a shard it lists, that is not what prepare wrote. Prepare
    refuses an existing --out without --force, so the fix says it."""
    return ("restore the files named from a copy, or prepare the folder again from its text "
            f"(its manifest.json's \"inputs\" and \"tokenizer\"): {_prepare_again(folder)}")


def _prepare_again(folder: str) -> str:
    """The command that rebuilds ``folder``. Prepare writes only a local --out: a folder on a
    store is prepared locally and copied over the damaged one (its --out with the URL is
    refused, "token shards are written to a local folder")."""
    if "://" in folder and not folder.startswith("file://"):
        return ("mscale data prepare INPUT... --tokenizer TOKENIZER --out LOCAL_FOLDER, then "
                f"copy LOCAL_FOLDER's files over {folder}")
    return f"mscale data prepare INPUT... --tokenizer TOKENIZER --out {folder} --force"


def _refuse(message: str, url: str, field: str, fix: str | None = None) -> MscaleError:
    folder = url[:-len(MANIFEST) - 1] if url.endswith("/" + MANIFEST) else url
    return MscaleError(message, file=url, field=field, fix=fix or reprepare(folder))


def _unreadable(message: str, url: str, field: str) -> MscaleError:
    """A manifest that is not ours to read: prepare's --force replaces only a folder whose
    manifest.json it can read, so the fix names a new folder."""
    return _refuse(message, url, field,
                   f"restore {url} from a copy, or prepare the text again into a new folder: "
                   "mscale data prepare INPUT... --tokenizer TOKENIZER --out NEW_FOLDER")


def _int_field(m: dict, key: str, url: str, field: str, minimum: int = 0) -> int:
    value = m.get(key)
    if not isinstance(value, int) or isinstance(value, bool) or value < minimum:
        raise _refuse(f"{key} must be an integer ≥ {minimum}, got {value!r}", url, field)
    return value


def load_manifest(folder: str) -> dict:
    """Our ``manifest.json``, every field checked for presence, type and safety."""
    url = join(folder, MANIFEST)
    blob = open_blob(url)
    try:
        m = json.loads(blob.read(0, blob.size))
    except (ValueError, UnicodeDecodeError) as e:
        raise _unreadable(f"not valid JSON ({e})", url, "manifest") from None
    if not isinstance(m, dict) or m.get("format") != FORMAT:
        raise _unreadable(f"format is {m.get('format') if isinstance(m, dict) else m!r}, not "
                          f"{FORMAT!r}", url, "manifest.format")
    if m.get("version") != VERSION:
        raise _refuse(f"unknown manifest version {m.get('version')!r}", url, "manifest.version",
                      "upgrade mscale (a newer one wrote it), or prepare the folder again with "
                      f"this one: {_prepare_again(folder)}")
    if not isinstance(m.get("tokenizer"), str):
        raise _refuse("tokenizer must be a string", url, "manifest.tokenizer")
    if m.get("dtype") not in TOKEN_DTYPES:
        raise _refuse(f"dtype {m.get('dtype')!r} is not one of {sorted(TOKEN_DTYPES)}", url,
                      "manifest.dtype")
    for key, low in (("vocab_size", 1), ("eod_id", 0), ("tokens", 0), ("documents", 0)):
        _int_field(m, key, url, f"manifest.{key}", low)
    if m["eod_id"] >= m["vocab_size"]:
        raise _refuse(f"eod_id {m['eod_id']} is outside the vocabulary ({m['vocab_size']})", url,
                      "manifest.eod_id")
    shards = m.get("shards")
    if not isinstance(shards, list) or not shards:
        raise _refuse("shards must be a non-empty list", url, "manifest.shards")
    for i, s in enumerate(shards):
        _check_shard_entry(s, url, f"manifest.shards[{i}]")
    if len({s["prefix"] for s in shards}) != len(shards):  # one shard counted twice
        raise _refuse("a shard prefix is listed twice", url, "manifest.shards")
    for key in ("tokens", "documents"):
        total = sum(s[key] for s in shards)
        if total != m[key]:
            raise _refuse(f"{key} is {m[key]} but the shards sum to {total}", url,
                          f"manifest.{key}")
    return m


IDENTITY_KEYS = ("tokenizer_sha256", "dtype", "vocab_size", "eod_id", "tokens", "documents")
SHARD_IDENTITY_KEYS = ("prefix", "tokens", "documents", "bin_bytes", "bin_sha256", "idx_sha256")


def manifest_digest(m: dict) -> str:
    """What a prepared folder holds, in 16 hex digits: a sha256 over the manifest's tokenizer
    checksum, dtype, counts and every shard's name, counts and sha256s (a checked manifest, `load_manifest`).

    No file is read beyond the manifest: the shards' own sha256s, recorded by prepare, stand for
    their contents. Fields that do not change the tokens (the input and tokenizer paths) are
    left out, so preparing the same text with the same tokenizer again gives the same digest,
    and any other text or tokenizer another (recorded by train in each checkpoint, so a resume
    notices a folder re-prepared under it: train/resumed.py)."""
    core = {k: m.get(k) for k in IDENTITY_KEYS}
    core["shards"] = [{k: s.get(k) for k in SHARD_IDENTITY_KEYS} for s in m["shards"]]
    text = json.dumps(core, sort_keys=True, separators=(",", ":"))
    return hashlib.sha256(text.encode()).hexdigest()[:16]


def _check_shard_entry(s: object, url: str, field: str) -> None:
    if not isinstance(s, dict):
        raise _refuse("a shard entry must be an object", url, field)
    prefix = s.get("prefix")
    # a name from a file never leaves its folder: no separators, no '..', not absolute
    if (not isinstance(prefix, str) or not prefix or prefix in (".", "..") or "/" in prefix
            or "\\" in prefix or "\x00" in prefix or ":" in prefix):
        raise _refuse(f"shard prefix {prefix!r} is not a plain file name inside the folder", url,
                      f"{field}.prefix", "list shards by their bare names, e.g. 'shard-00000'")
    for key in ("tokens", "documents", "bin_bytes"):
        _int_field(s, key, url, f"{field}.{key}")
    for key in ("bin_sha256", "idx_sha256"):
        if not isinstance(s.get(key), str):
            raise _refuse(f"{key} must be a hex string", url, f"{field}.{key}")


def check_shard(m: dict, i: int, url: str, dtype: np.dtype, **found: int) -> None:
    """Shard ``i`` of manifest ``m`` (at ``url``) as opened: its stored ``dtype`` and what it
    holds (``tokens``, ``documents``, ``bin_bytes``) must be what the manifest says."""
    s, field = m["shards"][i], f"manifest.shards[{i}]"
    for key, value in found.items():
        if value != s[key]:
            raise _refuse(f"the manifest says {s[key]} {key}, {s['prefix']}.idx/.bin hold "
                          f"{value}", url, f"{field}.{key}")
    if dtype.itemsize != TOKEN_DTYPES[m["dtype"]].itemsize:
        raise _refuse(f"{s['prefix']}.idx stores {dtype}, the manifest says {m['dtype']}", url,
                      "manifest.dtype")


def verify_checksums(folder: str, chunk_bytes: int = 8 << 20,
                     missing: list[str] | None = None,
                     progress: Callable[[int, int, int, int], None] | None = None) -> list[str]:
    """Every shard's .bin and .idx hashed against the manifest's sha256: one line per mismatch.
    ``missing`` (if given) collects the URLs of the files that are not there. ``progress`` (if
    given) is called with (files done, files, .bin bytes done, .bin bytes) before the first file
    and after each: a corpus of thousands of shards hashes for an hour."""
    problems = []
    shards = load_manifest(folder)["shards"]
    files, total = 2 * len(shards), sum(s["bin_bytes"] for s in shards)
    done = done_bytes = 0
    if progress is not None:
        progress(0, files, 0, total)
    for i, s in enumerate(shards):
        for ext in ("bin", "idx"):
            url = join(folder, f"{s['prefix']}.{ext}")
            if kind(url) != "file":
                problems.append(f"{url}: missing (manifest.shards[{i}].prefix)")
                if missing is not None:
                    missing.append(url)
            else:
                got = sha256(url, chunk_bytes)
                if got != s[f"{ext}_sha256"]:
                    problems.append(f"{url}: sha256 {got} != manifest.shards[{i}].{ext}_sha256 "
                                    f"{s[f'{ext}_sha256']}")
            done += 1
            done_bytes += s["bin_bytes"] if ext == "bin" else 0
            if progress is not None:
                progress(done, files, done_bytes, total)
    return problems
