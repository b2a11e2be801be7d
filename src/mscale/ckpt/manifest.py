"""The checkpoint manifest: the only description of a checkpoint that loaders and `verify` trust.

A checkpoint directory holds::

    step-000120/
      manifest.json          this schema: tensors, shards, training state, plan
      rank-00000.bin         one shard file per writing rank: raw tensor bytes in chunks only
      rank-00000.index.json  that shard's slices and chunk tables (a `ShardIndex`)
      ...
      COMMITTED              the commit marker, written last; names the manifest's sha256

A shard file has no header: it is the concatenation of the chunks its index lists, so the
manifest and the indexes say where every byte of every tensor is, and nothing in a shard is ever
parsed, let alone unpickled. Paths in a manifest are plain file names inside the checkpoint
directory.

Why the slices live beside their shard (schema 2) rather than in the manifest (schema 1, still
read): at 175B on 12,288 ranks the slice tables are 2.7 million entries, a 428 MB manifest that
every rank parsed at resume (75 s and 7 GB each) and rank 0 assembled at every commit (~80 s,
docs/benchmarks.md). Now the manifest is a few MB, a commit gathers a few hundred bytes a rank,
and a rank resuming at the layout that saved reads the indexes of the few shards it needs
(load.py). The manifest records each index's size and sha256, so the commit marker still covers
every byte a loader trusts.
"""

from __future__ import annotations

import hashlib
import re
import time
from typing import Annotated, Any, Literal

from pydantic import ConfigDict, Field, ValidationError, field_validator, model_validator

from mscale.ckpt import untrusted
from mscale.ckpt.limits import (MAX_BYTES, MAX_CHUNK_BYTES, MAX_INDEX_BYTES, MAX_LEVEL,
                                MAX_NDIM, MAX_NUMEL, MAX_SMALL_BYTES, MAX_STEP, MAX_WORLD,
                                MIN_LEVEL, U32)
from mscale.ckpt.untrusted import DAMAGED
from mscale.config.base import StrictModel, validation_to_error
from mscale.errors import EXIT_CRITICAL, MscaleError

MANIFEST_SCHEMA_VERSION = 2
"""2: slices in per-shard index files; 1: slices inline in the manifest (still read)."""
MANIFEST = "manifest.json"
COMMITTED = "COMMITTED"
FORMAT = "mscale-ckpt"
INDEX_FORMAT = "mscale-shard-index"

ELEMENT_SIZES = {"float32": 4, "float16": 2, "bfloat16": 2, "float64": 8, "int64": 8, "int32": 4,
                 "int16": 2, "int8": 1, "uint8": 1, "bool": 1}
"""Element types a checkpoint may hold, by the name the manifest uses (little-endian), and their
bytes. Their torch dtypes are `ckpt.format.torch_dtype`: this schema stays torch-free, so that the
launcher and the CLI can read and check manifests without importing torch."""
ELEMENT_TYPES = tuple(ELEMENT_SIZES)


def itemsize(dtype: str) -> int:
    """Bytes per element of the element type ``dtype``."""
    return ELEMENT_SIZES[dtype]

# Tensor keys: "<group>/<global name>". Groups:
MODEL = "model"
"""Model parameters (each TP slice written once, by one DP replica)."""
OPTIM_KEYS = ("master", "exp_avg", "exp_avg_sq")
"""Optimizer state per parameter; key ``optim.<key>/<name>``."""
MASTER_DTYPE = "float32"
MODEL_ALIAS = "optim.master"
"""`Manifest.model_alias`: fp32 parameters equal their master weights and are stored once."""
RNG = "rng"
"""Per-rank generator states; key ``rng.<kind>/rank-<r>``."""

_SAFE_NAME = re.compile(r"^[A-Za-z0-9][A-Za-z0-9._-]{0,200}$")
TENSOR_KEY = re.compile(r"^[A-Za-z0-9][A-Za-z0-9._-]{0,63}/[A-Za-z0-9][A-Za-z0-9._-]{0,400}$")

Count = Annotated[int, Field(ge=0, le=MAX_BYTES)]
Pair = Annotated[list[Count], Field(min_length=2, max_length=2)]
"""``[start, stop]`` of a box dimension or a flat range; ``[stored_bytes, crc32]`` of a chunk."""


def tensor_key(group: str, name: str) -> str:
    return f"{group}/{name}"


def optim_key(key: str, name: str) -> str:
    return tensor_key(f"optim.{key}", name)


def split_key(key: str) -> tuple[str, str]:
    group, _, name = key.partition("/")
    return group, name


def shard_name(rank: int) -> str:
    return f"rank-{rank:05d}.bin"


def index_name(rank: int) -> str:
    return f"rank-{rank:05d}.index.json"


def check_relative(path: str) -> str:
    """A manifest path must name a file directly inside the checkpoint directory: no absolute
    paths, no ``..``, no sub-directories, no odd characters. (Symlinks that leave the directory
    are refused where files are opened: `files.open_inside`.)"""
    if not _SAFE_NAME.match(path) or path in (".", ".."):
        raise ValueError(f"shard path {path!r} must be a plain file name inside the checkpoint "
                         "directory (no '/', '..', absolute paths or odd characters)")
    return path


class _Record(StrictModel):
    """Base of everything a checkpoint records: unknown fields refused, numbers finite."""

    model_config = ConfigDict(allow_inf_nan=False)


class TensorInfo(_Record):
    """One global tensor."""

    shape: list[Annotated[int, Field(ge=0, le=MAX_NUMEL)]] = Field(max_length=MAX_NDIM)
    """Global shape (before any tensor-parallel split)."""
    dtype: str
    """Element type, one of `ELEMENT_TYPES`."""

    @field_validator("dtype")
    @classmethod
    def _dtype(cls, v: str) -> str:
        if v not in ELEMENT_TYPES:
            raise ValueError(f"unknown dtype {v!r}; one of {sorted(ELEMENT_TYPES)}")
        return v

    @field_validator("shape")
    @classmethod
    def _shape(cls, v: list[int]) -> list[int]:
        n = 1
        for d in v:
            n *= d
        if n > MAX_NUMEL:
            raise ValueError(f"{n} elements, more than {MAX_NUMEL}")
        return v


class SliceInfo(_Record):
    """One region of a tensor held by a shard file: ``global[box]`` flattened, elements
    ``flat[0]:flat[1]``, stored from byte ``offset`` as the listed chunks."""

    tensor: str = Field(max_length=512)
    """Key of the tensor in `Manifest.tensors`."""
    box: list[Pair] = Field(max_length=MAX_NDIM)
    """``[start, stop]`` per dimension of the global tensor (the TP slice)."""
    flat: Pair
    """Range of the box's row-major flattening held here (a ZeRO shard cuts through rows)."""
    offset: Count
    """Byte offset of the first chunk in the shard file."""
    chunks: list[Pair]
    """``[stored_bytes, crc32]`` per chunk; every chunk but the last holds `Manifest.chunk_bytes`
    raw bytes."""

    @property
    def stored_bytes(self) -> int:
        return sum(c[0] for c in self.chunks)

    @property
    def count(self) -> int:
        return self.flat[1] - self.flat[0]

    def box_tuple(self) -> tuple[tuple[int, int], ...]:
        return tuple((int(a), int(b)) for a, b in self.box)


class IndexRef(_Record):
    """`ShardInfo.index`: where a shard's slice table is, and what its bytes must hash to."""

    path: str
    """File name inside the checkpoint directory."""
    bytes: int = Field(ge=2, le=MAX_INDEX_BYTES)
    sha256: str = Field(pattern=r"^[0-9a-f]{64}$")

    @field_validator("path")
    @classmethod
    def _path(cls, v: str) -> str:
        return check_relative(v)


class ShardInfo(_Record):
    """One shard file."""

    path: str
    """File name inside the checkpoint directory."""
    rank: int = Field(ge=0, lt=MAX_WORLD)
    """Global rank that wrote it."""
    bytes: Count
    """File size."""
    checksum: str = Field(pattern=r"^crc32-chunks:[0-9a-f]{8}$")
    """``crc32-chunks:<hex>``: crc32 over the little-endian crc32s of its chunks in file order,
    so it covers every byte; `verify` recomputes it from the file."""
    slices: list[SliceInfo] = []
    """Schema 1: the shard's slices, in file order. Schema 2 leaves this empty (``index``)."""
    index: IndexRef | None = None
    """Schema 2: the file that lists the shard's slices (a `ShardIndex`)."""

    @field_validator("path")
    @classmethod
    def _path(cls, v: str) -> str:
        return check_relative(v)


class ShardIndex(_Record):
    """``rank-NNNNN.index.json``: one shard's slices, in file order (schema 2)."""

    format: Literal["mscale-shard-index"] = INDEX_FORMAT
    shard: str
    """The shard file it describes (`ShardInfo.path`): an index cannot be swapped for another's."""
    rank: int = Field(ge=0, lt=MAX_WORLD)
    slices: list[SliceInfo]


class ClipState(_Record):
    """`AdaptiveClipper.state_dict()`, checked before the clipper trusts it."""

    version: Literal[1]
    ema: float = Field(ge=0)
    count: int = Field(ge=0, le=MAX_STEP)


class DataSourceRecord(_Record):
    """`TrainState.data_sources`: one token source as the checkpoint's run read it
    (train/resumed.py `identities`)."""

    path: str = Field(min_length=1, max_length=4096)
    """As the training file names it."""
    role: Literal["train", "eval"]
    """A training source (its held-out end included), or a held-out source given apart."""
    weight: float = Field(gt=0, le=1e6)
    """Its blend weight."""
    kind: Literal["manifest", "edges"]
    """How ``digest`` was taken: a prepared folder's manifest (its shards' sha256s), or the
    first and last MiB of tokens of another source with its size."""
    digest: str = Field(pattern=r"^[0-9a-f]{16}$")
    tokens: int = Field(ge=0, le=MAX_BYTES)
    documents: int | None = Field(default=None, ge=0, le=MAX_BYTES)
    """None for a source without document boundaries (a flat file)."""


class TrainState(_Record):
    """Everything besides tensors that a resumed run needs to continue exactly."""

    step: int = Field(ge=0, le=MAX_STEP)
    """Optimizer steps completed; also the data position and the LR schedule position."""
    samples: int = Field(ge=0, le=MAX_BYTES)
    """Global samples consumed, skipped windows included: where the next step's data starts
    (step · global_batch for a run that never skipped data or changed its batch; the loader
    counts on from here, train/data.py). Sources are functions of the sample index."""
    counts_skips: bool = False
    """True when ``samples`` includes skipped data windows; manifests written before it existed
    hold step · global_batch, and the loader adds the windows (`DataLoader.resume_from`)."""
    optimizer: Literal["adamw", "lamb"] | None = None
    """``adamw`` / ``lamb``; None for a model-only checkpoint (e.g. imported from HF)."""
    optimizer_step: int = Field(default=0, ge=0, le=MAX_STEP)
    """The optimizer's own step count (Adam bias correction)."""
    lr: float | None = Field(default=None, ge=0)
    """Learning rate of the last step taken (informational: the schedule is a function of step)."""
    clip: dict[str, Any] = {}
    """`AdaptiveClipper.state_dict()` (a `ClipState`), or empty."""
    data_fingerprint: int | None = Field(default=None, ge=0, le=U32)
    """crc32 of sample 0, to notice that the data changed under a resumed run."""
    rng_world: int | None = Field(default=None, ge=1, le=MAX_WORLD)
    """World size whose per-rank RNG states are stored (restored only at the same layout)."""
    data_sources: list[DataSourceRecord] | None = Field(default=None, max_length=8192)
    """Every token source's identity, to name the one that changed under a resumed run; None
    for synthetic data and checkpoints written before it (those fall back to
    ``data_fingerprint``)."""


class LayoutRecord(_Record):
    """`Manifest.layout`: the layout that wrote the checkpoint (ownership.layout_record)."""

    tp: int = Field(ge=1, le=MAX_WORLD)
    pp: int = Field(ge=1, le=MAX_WORLD)
    dp: int = Field(ge=1, le=MAX_WORLD)
    vpp: int = Field(ge=1, le=MAX_WORLD)
    zero_stage: Literal[0, 1, 2]
    world: int = Field(ge=1, le=MAX_WORLD)

    @model_validator(mode="after")
    def _world(self) -> "LayoutRecord":
        if self.world != self.tp * self.pp * self.dp:
            want = self.tp * self.pp * self.dp
            raise ValueError(f"world {self.world} is not tp·pp·dp = {want}")
        return self


class Manifest(_Record):
    """``manifest.json``."""

    schema_version: int = Field(default=MANIFEST_SCHEMA_VERSION, ge=1)
    format: Literal["mscale-ckpt"] = FORMAT
    step: int = Field(ge=0, le=MAX_STEP)
    time: float = Field(default_factory=time.time)
    codec: Literal["raw", "zstd"]
    """How chunks are stored: as is, or each one a zstd frame."""
    level: int = Field(default=0, ge=MIN_LEVEL, le=MAX_LEVEL)
    """zstd level (informational)."""
    chunk_bytes: int = Field(gt=0, le=MAX_CHUNK_BYTES)
    """Raw bytes per chunk (a multiple of 16, so no element straddles two chunks)."""
    byteorder: Literal["little"] = "little"
    layout: dict[str, Any]
    """A `LayoutRecord`: tp, pp, dp, vpp, zero_stage, world of the layout that wrote it."""
    plan: dict[str, Any]
    """The resolved plan (model, training, layout) the run used; a valid `Plan`."""
    state: TrainState
    tensors: dict[str, TensorInfo]
    shards: list[ShardInfo] = Field(max_length=MAX_WORLD)
    model_alias: Literal["optim.master"] | None = None
    """``optim.master``: a ``model/<name>`` tensor that is not listed is ``optim.master/<name>``
    (fp32 parameters are exactly their master weights after every step, so they are not
    written twice)."""

    @field_validator("schema_version")
    @classmethod
    def _version(cls, v: int) -> int:
        if v > MANIFEST_SCHEMA_VERSION:
            raise ValueError(f"schema_version {v} is newer than this mscale understands "
                             f"({MANIFEST_SCHEMA_VERSION})")
        return v

    @field_validator("chunk_bytes")
    @classmethod
    def _chunk(cls, v: int) -> int:
        if v % 16:
            raise ValueError("chunk_bytes must be a multiple of 16")
        return v

    @model_validator(mode="after")
    def _unique_paths(self) -> "Manifest":
        paths = [s.path for s in self.shards] + [s.index.path for s in self.shards if s.index]
        if len(set(paths)) != len(paths) or MANIFEST in paths or COMMITTED in paths:
            raise ValueError("shard and index paths must be distinct and not name the manifest "
                             "or marker")
        return self

    @model_validator(mode="after")
    def _slices_where_schema_says(self) -> "Manifest":
        indexed = self.schema_version >= 2
        for i, s in enumerate(self.shards):
            if indexed and (s.index is None or s.slices):
                raise ValueError(f"shards[{i}]: schema {self.schema_version} lists a shard's "
                                 "slices in its index file (index set, slices empty)")
            if not indexed and s.index is not None:
                raise ValueError(f"shards[{i}]: schema 1 lists slices inline, not in an index")
        return self

    def has(self, group: str) -> bool:
        return any(k.startswith(group + "/") or k.startswith(group + ".") for k in self.tensors)

    def resolve(self, key: str) -> str:
        """The stored tensor behind ``key`` (follows `model_alias`)."""
        group, name = split_key(key)
        if key not in self.tensors and group == MODEL and self.model_alias:
            return tensor_key(self.model_alias, name)
        return key


class CommitMarker(_Record):
    """``COMMITTED``: written after every shard is durable and the manifest is written."""

    schema_version: int = Field(default=MANIFEST_SCHEMA_VERSION, ge=1)
    step: int = Field(ge=0, le=MAX_STEP)
    manifest_sha256: str = Field(pattern=r"^[0-9a-f]{64}$")
    """sha256 of manifest.json's bytes: a manifest changed after the commit is refused."""
    time: float = Field(default_factory=time.time)


def manifest_bytes(manifest: Manifest) -> bytes:
    return manifest.model_dump_json().encode()


def sha256(data: bytes) -> str:
    return hashlib.sha256(data).hexdigest()


def strict_record(model, data, source: str, prefix: str = ""):
    """Validate untrusted data (strict: no "1" for 1, no 1.5 for an int); a failure is exit 2."""
    if not isinstance(data, dict):
        raise MscaleError(f"expected a JSON object, found {type(data).__name__}", file=source,
                          field=prefix.rstrip(".") or None, code=EXIT_CRITICAL)
    try:
        return model.model_validate(data, strict=True)
    except ValidationError as e:
        err = validation_to_error(e, source, prefix)
        err.code, err.fix = EXIT_CRITICAL, DAMAGED
        raise err from None


def parse_marker(data: bytes, source: str) -> CommitMarker:
    raw = untrusted.load_json(data, source, "commit marker", MAX_SMALL_BYTES)
    return strict_record(CommitMarker, raw, source)
