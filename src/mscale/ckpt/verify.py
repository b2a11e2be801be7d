"""`mscale ckpt verify`: trust nothing but the manifest, and check the manifest too.

Checks, in order (each problem names the file and field at fault):
1. the manifest parses against its schema (dtypes, paths that stay inside the directory);
2. the commit marker exists and names this manifest's sha256 and step;
3. structure: every shard's index file (schema 2) is there, of the recorded size and sha256, and
   names its shard; every slice names a known tensor, its box lies inside the tensor and its flat
   range inside the box, its chunk table matches its element count; the slices of a shard tile
   the file;
4. coverage: for every tensor, the distinct boxes tile the tensor without overlap and within each
   box the flat ranges tile the box: every element is stored exactly once;
5. files: every shard exists with the recorded size (``--quick`` stops here), and every chunk's
   crc32, decoded length and the shard checksum match.
"""

from __future__ import annotations

from collections import defaultdict
from dataclasses import asdict, dataclass, field

from mscale.ckpt import catalog
from mscale.ckpt.files import open_shard, shard_slices_many
from mscale.ckpt.format import ChunkError, Decoder, shard_checksum
from mscale.ckpt.checks import parse_manifest
from mscale.ckpt.manifest import COMMITTED, MANIFEST, Manifest, SliceInfo, itemsize, sha256
from mscale.ckpt.limits import MAX_MANIFEST_BYTES
from mscale.ckpt.progress import OnStart, Progress, Tally
from mscale.ckpt.slices import box_shape, contains, intersect, numel
from mscale.errors import MscaleError


@dataclass
class Problem:
    file: str
    """File at fault, relative to the checkpoint directory."""
    field: str | None
    message: str


@dataclass
class Report:
    path: str
    quick: bool
    step: int | None = None
    committed: bool = False
    shards: int = 0
    bytes: int = 0
    """Its size on disk, every file of the directory (`catalog.dir_bytes`): what ``ls`` shows."""
    shard_bytes: int = 0
    """The shards' bytes as the manifest records them: what the check reads (``progress``)."""
    tensors: int = 0
    layout: dict | None = None
    problems: list[Problem] = field(default_factory=list)

    @property
    def ok(self) -> bool:
        return not self.problems

    def to_json(self) -> dict:
        return {**asdict(self), "ok": self.ok}


def verify(path: str, quick: bool = False, progress: Progress | None = None,
           on_start: OnStart | None = None) -> Report:
    """Verify the checkpoint at ``path`` (a directory, a ``latest`` pointer, or a run).
    ``on_start`` is told what will be read (path, step, shards, tensors, its size on disk as
    ``bytes`` and the shards' as ``shard_bytes``) once the manifest parsed; ``progress`` the
    shard bytes checked, a shard's sizes alone with ``quick``
    (ckpt/progress.py). A manifest that does not parse ends the check before either."""
    ckpt = catalog.resolve(path)
    rep = Report(path=ckpt, quick=quick)
    try:
        raw = catalog.read_bytes(catalog.join(ckpt, MANIFEST), MAX_MANIFEST_BYTES)
    except MscaleError as e:  # a directory, a FIFO, too large: the checkpoint is damaged
        rep.problems.append(Problem(MANIFEST, e.field, e.message))
        _marker(ckpt, None, rep)
        return rep
    if raw is None:
        committed = catalog.read_bytes(catalog.join(ckpt, catalog.COMMITTED)) is not None
        rep.problems.append(Problem(MANIFEST, None, "missing, though COMMITTED says the "
                                    "checkpoint was completed: removed after the commit"
                                    if committed else "missing: the checkpoint was never "
                                    "completed"))
        _marker(ckpt, None, rep)
        return rep
    try:
        manifest = parse_manifest(raw, MANIFEST)
    except MscaleError as e:
        rep.problems.append(Problem(MANIFEST, e.field, e.message))
        _marker(ckpt, None, rep)
        return rep
    rep.step, rep.shards, rep.tensors = manifest.step, len(manifest.shards), len(manifest.tensors)
    rep.layout = manifest.layout
    rep.shard_bytes = sum(s.bytes for s in manifest.shards)
    rep.bytes = catalog.dir_bytes(ckpt)
    if on_start is not None:
        on_start({"path": ckpt, "quick": quick, "step": rep.step, "shards": rep.shards,
                  "tensors": rep.tensors, "bytes": rep.bytes, "shard_bytes": rep.shard_bytes,
                  "layout": rep.layout})
    _marker(ckpt, (raw, manifest), rep)
    _name(ckpt, manifest, rep)
    tables = slice_tables(ckpt, manifest, rep.problems)
    rep.problems += structure(manifest, tables)
    rep.problems += files(ckpt, manifest, quick, Tally(rep.shard_bytes, progress), tables)
    return rep


Tables = dict[str, list[SliceInfo]]
"""Each shard's slices by shard path; a shard whose index could not be read is absent."""


def slice_tables(ckpt: str, m: Manifest, problems: list[Problem]) -> Tables:
    """Every shard's slices (schema 2: its index file, read and checked; schema 1: inline); an
    index that cannot be used is a problem naming it, and its shard's slices stay unknown."""
    out: Tables = {}
    for shard, got in zip(m.shards, shard_slices_many(ckpt, m, m.shards)):
        where = shard.index.path if shard.index is not None else MANIFEST
        if isinstance(got, MscaleError):
            problems.append(Problem(where, got.field, got.message))
        elif isinstance(got, OSError):  # permissions, I/O errors: this index cannot be checked
            problems.append(Problem(where, None, f"cannot read it: {got.strerror or got}"))
        else:
            out[shard.path] = got
    return out


def _name(ckpt: str, manifest: Manifest, rep: Report) -> None:
    """A ``step-NNNNNN`` directory holds step NNNNNN (`catalog.misnamed`): one renamed (or
    copied) from another step passed verify, and ``--resume auto`` took it by its name."""
    if catalog.misnamed(ckpt, manifest.step) is not None:
        rep.problems.append(Problem(MANIFEST, "step", f"step {manifest.step}, but the directory "
                                    f"is named {catalog.basename(ckpt)}: rename it "
                                    f"{catalog.step_dir(manifest.step)} (ls, retention and "
                                    "--resume auto go by the name)"))


def _marker(ckpt: str, parsed, rep: Report) -> None:
    try:
        marker = catalog.load_marker(ckpt)
    except MscaleError as e:
        rep.problems.append(Problem(COMMITTED, e.field, e.message))
        return
    if marker is None:
        rep.problems.append(Problem(COMMITTED, None, "missing: the checkpoint was not committed "
                                    "(its write was interrupted or failed)"))
        return
    rep.committed = True
    if parsed is None:
        return
    raw, manifest = parsed
    if marker.manifest_sha256 != sha256(raw):
        rep.problems.append(Problem(MANIFEST, None, "sha256 differs from the one the commit "
                                    "marker recorded: changed after the commit"))
    if marker.step != manifest.step:
        rep.problems.append(Problem(COMMITTED, "step", f"marker says step {marker.step}, "
                                    f"manifest {manifest.step}"))


def structure(m: Manifest, tables: Tables) -> list[Problem]:
    """Schema-level consistency and exact coverage (checks 3 and 4)."""
    out: list[Problem] = []
    by_tensor: dict[str, list[tuple[str, tuple, tuple]]] = defaultdict(list)
    for shard in m.shards:
        if shard.path not in tables:
            continue
        offset = 0
        for i, s in enumerate(tables[shard.path]):
            where = f"slices[{i}]"
            info = m.tensors.get(s.tensor)
            if info is None:
                out.append(Problem(shard.path, where, f"unknown tensor {s.tensor}"))
                continue
            box = s.box_tuple()
            if len(box) != len(info.shape) or not contains(tuple((0, d) for d in info.shape), box) \
                    or any(a >= b for a, b in box):
                out.append(Problem(shard.path, where, f"{s.tensor}: box {s.box} is not inside "
                                   f"shape {info.shape}"))
                continue
            lo, hi = s.flat
            if not 0 <= lo < hi <= numel(box_shape(box)):
                out.append(Problem(shard.path, where, f"{s.tensor}: flat range {s.flat} is not "
                                   f"inside its box of {numel(box_shape(box))} elements"))
                continue
            raw = (hi - lo) * itemsize(info.dtype)
            if len(s.chunks) != -(-raw // m.chunk_bytes):
                out.append(Problem(shard.path, where, f"{s.tensor}: {len(s.chunks)} chunks for "
                                   f"{raw} bytes of {m.chunk_bytes}-byte chunks"))
            if s.offset != offset:
                out.append(Problem(shard.path, where, f"{s.tensor}: starts at byte {s.offset}, "
                                   f"expected {offset} (slices must tile the file)"))
            offset = s.offset + s.stored_bytes
            by_tensor[s.tensor].append((shard.path, box, (lo, hi)))
        if offset != shard.bytes:
            out.append(Problem(shard.path, "bytes", f"slices end at byte {offset}, the manifest "
                               f"says the file has {shard.bytes}"))
    if len(tables) < len(m.shards):  # an unreadable index is the problem: its slices are unknown,
        return out                    # and the tensors they hold would all read as "missing"
    for key, info in m.tensors.items():
        out += coverage(key, info.shape, by_tensor.get(key, []))
    return out


def coverage(key: str, shape: list[int], pieces: list[tuple[str, tuple, tuple]]) -> list[Problem]:
    """Every element of ``key`` stored exactly once (the invariant in the module docstring)."""
    if not pieces:
        return [Problem(MANIFEST, f"tensors.{key}", "no shard holds any of it")]
    by_box: dict[tuple, list[tuple[int, int, str]]] = defaultdict(list)
    for path, box, (lo, hi) in pieces:
        by_box[box].append((lo, hi, path))
    out = []
    boxes = list(by_box)
    for i, a in enumerate(boxes):
        for b in boxes[i + 1:]:
            if intersect(a, b) is not None:
                paths = sorted({p for _, _, p in by_box[a] + by_box[b]})
                out.append(Problem(paths[0], f"tensors.{key}", f"boxes {list(a)} and {list(b)} "
                                   f"overlap (shards {', '.join(paths)})"))
    total = sum(numel(box_shape(b)) for b in boxes)
    if total != numel(shape):
        out.append(Problem(MANIFEST, f"tensors.{key}", f"boxes hold {total} of {numel(shape)} "
                           "elements: part of the tensor is missing"))
    for box, ranges in by_box.items():
        end = 0
        for lo, hi, path in sorted(ranges):
            if lo != end:
                what = "overlaps the previous slice" if lo < end else f"leaves [{end}, {lo}) missing"
                out.append(Problem(path, f"tensors.{key}", f"box {list(box)}: range [{lo}, {hi}) "
                                   f"{what}"))
            end = max(end, hi)
        if end != numel(box_shape(box)):
            out.append(Problem(MANIFEST, f"tensors.{key}", f"box {list(box)}: elements from {end} "
                               "on are missing"))
    return out


def files(ckpt: str, m: Manifest, quick: bool, tally: Tally | None,
          tables: Tables) -> list[Problem]:
    """Shard presence, kind and size; without ``quick``, every chunk and the shard checksums
    (of the shards whose slices are known).
    ``tally`` counts the chunks' stored bytes as they are read; a shard that ends early (or
    cannot be opened) counts whole, so that the count ends at the manifest's total."""
    out = []
    decoder = Decoder(m.codec, m.chunk_bytes)
    tally = tally or Tally(sum(s.bytes for s in m.shards))
    for shard in m.shards:
        start = tally.done
        try:
            with open_shard(ckpt, shard) as fh:
                if not quick and shard.path in tables:
                    out += _chunks(fh, shard, tables[shard.path], m, decoder, tally)
        except MscaleError as e:
            out.append(Problem(shard.path, e.field, e.message))
        except OSError as e:  # permissions, I/O errors: this file cannot be checked
            out.append(Problem(shard.path, None, f"cannot read it: {e.strerror or e}"))
        tally.to(start + shard.bytes)
    return out


def _chunks(fh, shard, slices: list[SliceInfo], m: Manifest, decoder: Decoder,
            tally: Tally) -> list[Problem]:
    crcs, bad = [], []
    for i, s in enumerate(slices):
        info = m.tensors.get(s.tensor)
        if info is None:
            continue
        fh.seek(s.offset)
        lens = decoder.raw_lengths(s, itemsize(info.dtype))
        for j, (stored, crc) in enumerate(s.chunks):
            data = memoryview(fh.read(stored))
            tally.add(len(data))
            crcs.append(crc)
            try:
                decoder.decode(data, crc, lens[j], f"{s.tensor} chunk {j}")
            except ChunkError as e:
                bad.append(Problem(shard.path, f"slices[{i}]", str(e)))
    if shard_checksum(crcs) != shard.checksum:
        bad.append(Problem(shard.path, "checksum", "the chunk checksums do not combine to the "
                           "recorded shard checksum"))
    return bad
