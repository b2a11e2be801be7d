"""Loading with resharding: any rank of any layout reads exactly the regions it holds.

`CheckpointReader.read` returns one region (box + flat range) of a global tensor, assembled from
whichever saved slices overlap it (slices.py does the index work; only the chunks that cover the
overlap are read and decoded). Nothing else is needed for a layout change: TP changes the boxes,
ZeRO/DP changes the flat ranges, PP changes which parameters a rank holds, and each rank asks for
what it holds now by global name.

Which slices exist is read from the shards' index files (schema 2; manifest.py), and only as far
as needed: a resuming rank reads the indexes of the shards that `locate.likely_writers` names
(its own and a few others at the TP/PP split that saved, a few dozen at another; not 12,288). A guess that misses
costs time, never correctness: a region the read indexes do not cover makes the reader read
every other index before it answers, and a region no slice covers is an error.

`read_for_rank` then `install` restore a live training process (`LiveRank`):
- with optimizer state: every rank reads its ZeRO shard of master, exp_avg and exp_avg_sq and
  the model parameters are rebuilt from the masters by the optimizer's all-gather (the parameters
  *are* the masters after every step), so under ZeRO 1/2 each replica reads 1/dp and none reads
  the model tensors at all. Under ZeRO 0 every replica needs everything: DP rank 0 reads and
  broadcasts to its replicas (MegaScale's recovery path);
- model-only checkpoints (an HF import) load the parameters and start a fresh optimizer.
"""

from __future__ import annotations

from collections import defaultdict
from collections.abc import Collection

import torch
import torch.distributed as dist

from mscale.ckpt.files import open_shard, shard_slices_many
from mscale.ckpt.format import ChunkError, Decoder, torch_dtype
from mscale.ckpt.live import LiveRank, OptimizerState
from mscale.ckpt.manifest import MODEL, OPTIM_KEYS, Manifest, SliceInfo, split_key
from mscale.ckpt.ownership import Item, RankLayout, model_needs, optim_needs
from mscale.ckpt.slices import Box, copy_overlap, intersect, rows_box
from mscale.errors import EXIT_CRITICAL, MscaleError


class CheckpointReader:
    """Reads regions of a committed checkpoint's tensors; keeps its shard files open.
    ``prefer``: the ranks whose shards hold what this reader will be asked for (their indexes
    are read first; the rest only if a region needs them); None reads every index."""

    def __init__(self, ckpt_dir: str, manifest: Manifest, prefer: Collection[int] | None = None):
        self.dir, self.manifest = ckpt_dir, manifest
        self.decoder = Decoder(manifest.codec, manifest.chunk_bytes)
        self.slices: dict[str, list[tuple[str, SliceInfo]]] = defaultdict(list)
        self.shards = {shard.path: shard for shard in manifest.shards}
        self._unread = {shard.rank: shard for shard in manifest.shards}
        self.indexes_read = 0
        """Shards whose slice tables this reader has read (an index file each, schema 2)."""
        self.widened = False
        """True once a region sent it past ``prefer`` to every index (a wrong guess)."""
        self._files: dict[str, object] = {}
        self.bytes_read = 0
        self._read_tables(prefer)

    def _read_tables(self, ranks: Collection[int] | None = None) -> None:
        """Learn the slices of ``ranks``' shards (None: every shard not read yet)."""
        todo = [self._unread.pop(r) for r in sorted(self._unread if ranks is None else set(ranks))
                if r in self._unread]
        tables = shard_slices_many(self.dir, self.manifest, todo)
        failed = next((t for t in tables if isinstance(t, BaseException)), None)
        if failed is not None:
            raise failed
        for shard, slices in zip(todo, tables):
            for s in slices:
                self.slices[s.tensor].append((shard.path, s))
        self.indexes_read += len(todo)

    def __enter__(self) -> "CheckpointReader":
        return self

    def __exit__(self, *exc) -> None:
        self.close()

    def _file(self, name: str):
        """The open shard file (checked to be a regular file of the recorded size)."""
        if name not in self._files:
            self._files[name] = open_shard(self.dir, self.shards[name])
        return self._files[name]

    def close(self) -> None:
        for f in self._files.values():
            f.close()
        self._files.clear()

    def has(self, key: str) -> bool:
        return self.manifest.resolve(key) in self.manifest.tensors

    def read(self, key: str, box: Box, flat: tuple[int, int],
             shape: tuple[int, ...] | None = None, out: torch.Tensor | None = None) -> torch.Tensor:
        """Elements ``flat`` of ``global[box]`` (row-major) of tensor ``key``, as a 1-D tensor
        (a ``model/`` key may be served by its master weights: `Manifest.model_alias`)."""
        key = self.manifest.resolve(key)
        info = self.manifest.tensors.get(key)
        if info is None:
            raise MscaleError(f"the checkpoint has no tensor {key}", file=self.dir,
                              field="tensors", fix="was it saved from a different model? "
                              "compare the plan's model section with the checkpoint's")
        if shape is not None and tuple(info.shape) != tuple(shape):
            raise MscaleError(f"{key} has shape {info.shape} in the checkpoint, {list(shape)} in "
                              "this model", file=self.dir, field=f"tensors.{key}.shape",
                              fix="load into the same model configuration (model: section); "
                                  "if that is the one the checkpoint was saved with, its "
                                  "manifest is damaged: run `mscale ckpt verify` on it")
        if out is None:
            out = _empty(flat[1] - flat[0], torch_dtype(info.dtype), key, self.dir)
        exact = self._exact(key, box, flat)
        if exact is not None and out.is_contiguous() and out.dtype == torch_dtype(info.dtype):
            # saved at this very layout
            path, s = exact
            self.bytes_read += out.numel() * out.element_size()
            self._guard(path, key, lambda: self.decoder.read_whole(self._file(path), s, out))
            return out
        want = rows_box(box, flat)
        copied, counted = 0, self.bytes_read
        for path, s in self.slices.get(key, []):
            src_box, src_flat = s.box_tuple(), (s.flat[0], s.flat[1])
            if intersect(want, rows_box(src_box, src_flat)) is None:
                continue

            def fetch(lo: int, hi: int, path=path, s=s) -> torch.Tensor:
                self.bytes_read += (hi - lo) * out.element_size()
                return self._guard(path, key, lambda: self.decoder.read(
                    self._file(path), s, info.dtype, lo, hi))

            copied += copy_overlap(out, box, flat, src_box, src_flat, fetch)
        if copied != out.numel() and self._unread:  # the preferred shards did not hold it all
            self.widened, self.bytes_read = True, counted  # read again whole below
            self._read_tables()
            return self.read(key, box, flat, shape, out)
        if copied != out.numel():
            raise MscaleError(f"{key}{list(box)}[{flat[0]}:{flat[1]}]: slices cover {copied} of "
                              f"{out.numel()} elements", file=self.dir, field=f"tensors.{key}",
                              code=EXIT_CRITICAL, fix="run `mscale ckpt verify` on it")
        return out

    def _exact(self, key: str, box: Box, flat: tuple[int, int]):
        """The one saved slice that is exactly this region, if any."""
        for path, s in self.slices.get(key, []):
            if tuple(s.flat) == tuple(flat) and s.box_tuple() == tuple(box):
                return path, s
        return None

    def _guard(self, path: str, key: str, fn):
        """Run a read; a damaged chunk becomes an error naming the shard file once (as the
        file; the message says only which chunk and what is wrong)."""
        try:
            return fn()
        except ChunkError as e:
            raise MscaleError(str(e), file=f"{self.dir}/{path}", field=key, code=EXIT_CRITICAL,
                              fix="run `mscale ckpt verify`; use an older checkpoint (`mscale "
                                  "ckpt ls RUN` lists them): train --resume "
                                  "RUN/ckpt/step-NNNNNN, or convert that directory")

    def read_item(self, it: Item) -> torch.Tensor:
        return self.read(it.key, it.box, it.flat, it.shape).to(torch_dtype(it.dtype))

    def read_full(self, key: str) -> torch.Tensor:
        """A whole global tensor (for conversion and tests)."""
        shape = tuple(self.manifest.tensors[self.manifest.resolve(key)].shape)
        box = tuple((0, d) for d in shape)
        n = 1
        for d in shape:
            n *= d
        return self.read(key, box, (0, n)).view(shape)


def _empty(n: int, dtype: torch.dtype, key: str, where: str) -> torch.Tensor:
    """A buffer for ``n`` elements; a size this machine cannot hold is the manifest's claim to
    answer for (it may be a tampered shape), not an allocator traceback."""
    try:
        return torch.empty(n, dtype=dtype)
    except (RuntimeError, MemoryError):
        gb = n * torch.empty((), dtype=dtype).element_size() / 1e9
        raise MscaleError(f"{key} needs {gb:.1f} GB, more memory than this process can allocate",
                          file=where, field=f"tensors.{key}", code=EXIT_CRITICAL,
                          fix="check the shape the manifest records (mscale ckpt verify)") from None


def has_optimizer(manifest: Manifest) -> bool:
    return any(split_key(k)[0] == f"optim.{OPTIM_KEYS[0]}" for k in manifest.tensors)


def read_optimizer(reader: CheckpointReader, rl: RankLayout,
                   flats: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
    """Read this rank's optimizer state straight into ``flats`` (its flat tensors, on the CPU:
    no extra copy, no fresh pages)."""
    for it in optim_needs(rl):
        _, key, k = it.source
        pc = rl.pieces[k]
        reader.read(it.key, it.box, it.flat, it.shape,
                    out=flats[key][pc.owned_lo: pc.owned_lo + it.count])
    return flats


def read_model(reader: CheckpointReader, rl: RankLayout) -> list[torch.Tensor]:
    """This rank's parameters (flat, in parameter order) from the checkpoint."""
    return [reader.read_item(it) for it in model_needs(rl)]


def install(live: LiveRank, rl: RankLayout, manifest: Manifest, data: dict) -> None:
    """Put what `read_for_rank` returned into the live process (collectives: the ZeRO-0
    broadcast and the optimizer's parameter all-gather)."""
    opt, g = live.optimizer, live.groups
    if "optim" in data:
        flats = data["optim"]  # on a GPU, host copies: `load_state_dict` copies piece by piece
        if rl.zero_stage == 0 and g.dp_size > 1:  # one reader per DP group, broadcast
            flats = _broadcast_into(opt, flats, g)
        step = manifest.state.optimizer_step
    else:
        params = data["model"]  # host tensors, like the state built from them below
        master = torch.zeros(opt.master.shape, dtype=opt.master.dtype)
        for pc in rl.pieces:
            master[pc.owned_lo: pc.owned_lo + pc.hi - pc.lo] = params[pc.param][pc.lo: pc.hi]
        flats = {"master": master, "exp_avg": torch.zeros_like(master),
                 "exp_avg_sq": torch.zeros_like(master)}
        step = 0
    state = {}
    for pc in rl.pieces:
        name = rl.params[pc.param].spec.name
        n = pc.hi - pc.lo
        state[name] = {"range": (pc.lo, pc.hi),
                       **{k: flats[k][pc.owned_lo: pc.owned_lo + n] for k in OPTIM_KEYS}}
    opt.load_state_dict({"step": step, "optimizer": opt.kind, "state": state})


def _broadcast_into(opt, flats: dict[str, torch.Tensor], g) -> dict[str, torch.Tensor]:
    """DP rank 0's optimizer state into every DP rank's own optimizer tensors, one at a time.
    On a GPU, moving all three host copies to the device first held a second copy of the
    optimizer state (12 bytes a parameter) beside the optimizer's own at every resume; on a CPU
    ``flats`` already are the optimizer's tensors (`read_for_rank`)."""
    out = {}
    for k in OPTIM_KEYS:
        own = getattr(opt, k)
        if g.dp_rank == 0 and flats[k] is not own:
            own.copy_(flats[k])
        dist.broadcast(own, src=g.dp_ranks[0], group=g.dp_group)
        out[k] = own
    return out


def read_for_rank(reader: CheckpointReader, rl: RankLayout, optimizer: OptimizerState) -> dict:
    """File reads only (no collectives), so that a failure on one rank can be agreed on before
    anyone enters a collective: ``{"optim": flats}`` or ``{"model": params}``. On a CPU the
    optimizer state is read in place into ``optimizer``'s own tensors."""
    if has_optimizer(reader.manifest):
        flats = {k: getattr(optimizer, k) for k in OPTIM_KEYS}
        if any(t.device.type != "cpu" for t in flats.values()):
            flats = {k: torch.empty(t.numel()) for k, t in flats.items()}
        if rl.zero_stage == 0 and rl.dp_size > 1 and rl.dp_rank != 0:
            return {"optim": flats}  # filled by DP rank 0's broadcast in `install`
        return {"optim": read_optimizer(reader, rl, flats)}
    if not reader.manifest.has(MODEL) and not reader.manifest.model_alias:
        raise MscaleError("the checkpoint holds neither optimizer state nor model weights",
                          file=reader.dir, field="tensors", code=EXIT_CRITICAL)
    return {"model": read_model(reader, rl)}
