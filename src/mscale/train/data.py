"""Token sources: a memory-mapped token file and a learnable synthetic stream.

Both are pure functions of a global sample index, so every layout sees exactly the same global
batch at every step (the numerics tests rely on it) and resuming needs no state beyond the number
of samples consumed. Sample k of step t for DP rank d, micro-batch j is global index
``t·B + d·(B/dp) + j·mb + i``: the union over ranks is always the same B sequences.

Only TP rank 0 of each group reads; it broadcasts to its TP peers (the paper removed these
redundant loaders). Under pipelining only the first stage needs inputs and only the last labels.
"""

from __future__ import annotations

import threading
import zlib
from dataclasses import dataclass

import numpy as np
import torch
import torch.distributed as dist

from mscale.config.records import DataSkips
from mscale.config.training import DataConfig
from mscale.data.blend import BlendedSamples, build_splits
from mscale.distributed.collectives import COMM_CLOCK
from mscale.errors import MscaleError
from mscale.train.resumed import DataIdentity, split_identity


READ_THREADS = 2
"""Reads in flight per reader rank on a remote source: two hide a store's 20 ms per read behind
the demo's 0.2 s step (2.9% of it waited, against 38% with one and 7% with four, whose threads
contend for the GIL: docs/benchmarks.md, "Data path")."""


class DatasetTokens:
    """Real token data (docs/data.md): one split of the training file's sources, blended,
    shuffled and packed by `mscale.data.blend`, as int64 tensors."""

    def __init__(self, samples: BlendedSamples, held_out: BlendedSamples | None = None):
        self.samples, self.seq_len = samples, samples.seq_len
        self.held_out = held_out
        """The held-out split's samples (`source_fingerprint` records its sources too)."""
        remote = any("://" in url and not url.startswith("file://") for url in samples.sources)
        self.read_threads = READ_THREADS if remote else 1
        """Reads in flight ahead of the step: a remote store's reads wait on its latency and
        overlap; a local read is CPU (the index maths), and more threads only contend for the
        GIL with the training thread (measured: docs/benchmarks.md, "Data path")."""

    def sample(self, k: int) -> torch.Tensor:
        return torch.from_numpy(self.samples.sample(k))

    def batch(self, ks: list[int]) -> torch.Tensor:
        """[len(ks), seq_len + 1]: one read per sample, one tensor."""
        return torch.from_numpy(self.samples.samples(ks))


class SyntheticTokens:
    """A seeded stream a tiny model can learn: each token is usually a fixed function of the
    previous one (a random permutation of the vocabulary) and sometimes a random token. Loss
    falls from ln(V) toward the noise floor, so a demo shows learning."""

    def __init__(self, seed: int, seq_len: int, vocab: int, noise: float = 0.1):
        self.seed, self.seq_len, self.vocab, self.noise = seed, seq_len, vocab, noise
        g = torch.Generator().manual_seed(seed)
        self.successor = torch.randperm(vocab, generator=g)
        self._successor = self.successor.tolist()

    def sample(self, k: int) -> torch.Tensor:
        """Sample ``k``. Each token depends on the one before, so the chain is a loop; it runs
        over Python ints, not tensor elements (indexing a tensor per token cost ~0.13 s per step
        of 16 × 2,049 tokens: a quarter of a 0.9B model's step on an H200 was data wait)."""
        g = torch.Generator().manual_seed(self.seed * 1_000_003 + k)
        n = self.seq_len + 1
        rand = torch.randint(0, self.vocab, (n,), generator=g).tolist()
        keep = (torch.rand(n, generator=g) >= self.noise).tolist()
        successor, out = self._successor, [rand[0]]
        for i in range(1, n):
            out.append(successor[out[-1]] if keep[i] else rand[i])
        return torch.tensor(out, dtype=torch.int64)

    def batch(self, ks: list[int]) -> torch.Tensor:
        return torch.stack([self.sample(k) for k in ks])


SYNTHETIC_EVAL_SALT = 0x0E7A1
"""The held-out synthetic stream: the same chain (successor table) with other random draws."""


def make_sources(cfg: DataConfig, seed: int, seq_len: int, vocab: int):
    """(training source, held-out source or None) of a training file's ``data`` section."""
    if cfg.kind == "tokens":
        train, held = build_splits(cfg, seq_len, seed, vocab)
        return (DatasetTokens(train, held),
                DatasetTokens(held) if held is not None else None)
    held = SyntheticTokens(seed, seq_len, vocab)
    held.seed = seed ^ SYNTHETIC_EVAL_SALT  # same successor table, other samples
    return SyntheticTokens(seed, seq_len, vocab), held


def make_source(cfg: DataConfig, seed: int, seq_len: int, vocab: int):
    """The training source alone (tools and tests that do not evaluate)."""
    return make_sources(cfg, seed, seq_len, vocab)[0]


@dataclass
class BatchPlan:
    """Which global samples a rank's micro-batches hold."""

    global_batch: int
    micro_batch: int
    dp_size: int
    dp_rank: int

    @property
    def micro_batches(self) -> int:
        return self.global_batch // (self.dp_size * self.micro_batch)

    def indices_from(self, start: int, micro: int) -> list[int]:
        """Global sample indices of micro-batch ``micro`` on this DP rank of a step whose global
        batch starts at sample ``start``."""
        first = start + self.dp_rank * (self.global_batch // self.dp_size) + micro * self.micro_batch
        return list(range(first, first + self.micro_batch))


class DataLoader:
    """Micro-batches for one rank: read by TP rank 0, broadcast to the TP group.

    The data position counts from ``origin``, the (step, samples) of the checkpoint the run
    resumed from ((0, 0) for a fresh run; `ckpt.manifest.TrainState.samples`): each step takes
    the next global batch, and ``skips`` (RUN/data_skip.json, written by `mscale recover` on a
    rollback) move whole steps, the same on every rank, so a skipped window is passed over by
    the whole global batch. Counting from the checkpoint's samples, not from step · batch, lets
    a restart change the global batch (``train --allow-batch-change``) without reading a sample
    twice or leaving a gap."""

    def __init__(self, source, plan: BatchPlan, tp_group=None, tp_src: int = 0, tp_size: int = 1,
                 is_reader: bool = True, skips: DataSkips | None = None, read_ahead: int = 0):
        self.source, self.plan = source, plan
        self.tp_group, self.tp_src, self.tp_size, self.is_reader = tp_group, tp_src, tp_size, is_reader
        self.skips = skips or DataSkips()
        self.ahead = ReadAhead(source.batch, read_ahead * plan.micro_batches,
                               getattr(source, "read_threads", 1)) \
            if read_ahead and is_reader else None
        """Reads the next steps' micro-batches in a background thread (``data.read_ahead``)."""
        self.origin: tuple[int, int] = (0, 0)
        """(step, samples consumed) where the count starts: the resumed checkpoint's."""

    def resume_from(self, step: int, samples: int, counts_skips: bool) -> None:
        """Count on from a checkpoint at ``step`` that consumed ``samples``. A manifest written
        before checkpoints counted skipped windows (``counts_skips`` False) holds step · batch:
        the windows recorded before ``step`` are added, at that batch."""
        if not counts_skips and step:
            samples += self.skips.skipped_samples(0, step - 1, samples // step)
        self.origin = (step, samples)

    def start_of(self, step: int) -> int:
        """First global sample (0-based) ``step`` reads: the origin's samples, one global batch
        per step since, and the windows skipped since (recorded after the origin's step up to
        this one; earlier ones are in the origin's samples)."""
        batch = self.plan.global_batch
        return self.consumed_before(step) + self.skips.skipped_samples(step, step, batch)

    def consumed_before(self, step: int) -> int:
        """Samples consumed, skipped windows included, before (0-based) ``step``: what a
        checkpoint after ``step`` steps records as its ``samples``. A window recorded after
        ``step`` itself is not in it (a rollback to that checkpoint adds it after the fact)."""
        k, samples = self.origin
        batch = self.plan.global_batch
        return samples + (step - k) * batch + self.skips.skipped_samples(k, step - 1, batch)

    def get(self, step: int, micro: int) -> tuple[torch.Tensor, torch.Tensor]:
        """(inputs, labels), each [micro_batch, seq_len] int64."""
        shape = (self.plan.micro_batch, self.source.seq_len + 1)
        if self.is_reader:
            ids = self.plan.indices_from(self.start_of(step), micro)
            if self.ahead is None:
                batch = self.source.batch(ids)
            else:
                batch = self.ahead.take(ids, self._following(step, micro))
        else:
            batch = torch.empty(shape, dtype=torch.int64)
        if self.tp_size > 1:
            with COMM_CLOCK.timed("tp"):  # waiting for a late TP peer is communication, not I/O
                dist.broadcast(batch, src=self.tp_src, group=self.tp_group)
        return batch[:, :-1].contiguous(), batch[:, 1:].contiguous()


    def _following(self, step: int, micro: int):
        """The sample ids of the micro-batches after (step, micro), in the order they are read."""
        m = self.plan.micro_batches
        while True:
            micro += 1
            if micro == m:
                step, micro = step + 1, 0
            yield self.plan.indices_from(self.start_of(step), micro)

    def close(self) -> None:
        if self.ahead is not None:
            self.ahead.close()


class ReadAhead:
    """Background threads that read the micro-batches a rank will ask for next.

    Keyed by the sample ids themselves, so a change of origin or skipped windows can never hand
    out a stale batch: a read ahead that is not asked for is dropped. Several threads, so that
    several reads are in flight: a remote store answers each range read after its latency, and
    one reader at a time cannot keep up with a step that needs a dozen of them
    (docs/benchmarks.md, "Data path"). The reads are pure functions of the ids; an error in one
    (a store that stays down after its retries, data/storage.py) is raised by `take`, in the
    training thread, with its message intact. The threads are daemons: a store that hangs
    cannot keep a finished process alive."""

    def __init__(self, read, depth: int, threads: int = 1):
        self.read, self.depth = read, depth
        self._cv = threading.Condition()
        self._queue: list[tuple[int, ...]] = []
        self._done: dict[tuple[int, ...], object] = {}
        self._busy: set[tuple[int, ...]] = set()
        self._closed = False
        for i in range(max(1, threads)):
            threading.Thread(target=self._run, name=f"mscale-read-ahead-{i}", daemon=True).start()

    def take(self, ids: list[int], following) -> torch.Tensor:
        key = tuple(ids)
        with self._cv:
            if not self._known(key):
                self._queue.insert(0, key)
            wanted = {key}
            for nxt in following:
                if len(wanted) > self.depth:
                    break
                nxt = tuple(nxt)
                wanted.add(nxt)
                if not self._known(nxt):
                    self._queue.append(nxt)
            for stale in [k for k in self._done if k not in wanted]:
                del self._done[stale]
            self._queue = [k for k in self._queue if k in wanted]
            self._cv.notify_all()
            while key not in self._done:
                self._cv.wait()
            out = self._done.pop(key)
        if isinstance(out, BaseException):
            raise out
        return out

    def _known(self, key) -> bool:
        """Read, being read, or queued (call with the lock held)."""
        return key in self._done or key in self._busy or key in self._queue

    def _run(self) -> None:
        while True:
            with self._cv:
                while not self._queue and not self._closed:
                    self._cv.wait()
                if self._closed:
                    return
                key = self._queue.pop(0)
                self._busy.add(key)
            try:
                out = self.read(list(key))
            except BaseException as e:  # handed to the training thread by take()
                out = e
            with self._cv:
                self._done[key] = out
                self._busy.discard(key)
                self._cv.notify_all()

    def close(self) -> None:
        with self._cv:
            self._closed = True
            self._cv.notify_all()


def source_fingerprint(source) -> DataIdentity:
    """What a resumed run compares to tell whether its data changed under it: a checksum of the
    first sample, and every source's identity."""
    samples = getattr(source, "samples", None)
    if isinstance(samples, BlendedSamples):
        return split_identity(samples, getattr(source, "held_out", None))
    return DataIdentity(zlib.crc32(source.sample(0).numpy().tobytes()))


def data_shape(source) -> list[int]:
    """What every rank must see alike of its sources: their token and document counts, training
    and held-out (zeros for the synthetic stream). Ranks open the files each on their own, so
    node-local copies that differ, a glob listed while shards were still arriving, or a stale
    object-store listing give ranks different samples at the same index: a pipeline's inputs
    and labels then come from different places, without an error."""
    out = []
    for split in (getattr(source, "samples", None), getattr(source, "held_out", None)):
        parts = split.parts if isinstance(split, BlendedSamples) else []
        out += [sum(p.dataset.num_tokens for p in parts),
                sum(p.dataset.documents or 0 for p in parts)]
    return out


def check_same_data_everywhere(source) -> None:
    """Collective: every rank's `data_shape` against every other's (one MAX all-reduce of the
    shape and its negation: the maximum and the minimum at once, at the start); a difference
    stops the job on every rank at once, before a step is trained."""
    if not dist.is_initialized():
        return
    shape = torch.tensor(data_shape(source), dtype=torch.float64)
    both = torch.cat([shape, -shape])
    dist.all_reduce(both, op=dist.ReduceOp.MAX)
    hi, lo = both[:len(shape)], -both[len(shape):]
    if not torch.equal(lo, hi):
        raise MscaleError(f"the ranks see different data: token counts {int(lo[0]):,} to "
                          f"{int(hi[0]):,}, document counts {int(lo[1]):,} to {int(hi[1]):,} "
                          "(training sources); samples at one index would differ between ranks",
                          field="training.data",
                          fix="give every node the same files (a shared filesystem, or copies "
                              "finished before the job starts), and a glob no writer is adding "
                              "to")


def never_evaluated(training) -> str | None:
    """A line when real data holds a split out that no evaluation reads (``eval.interval`` 0):
    its tokens are never trained on and never measured, and nothing else would say so."""
    data = training.data
    if data.kind == "tokens" and data.has_eval and not training.eval.interval:
        return ("note: a held-out split is set aside but never evaluated (training.eval.interval "
                "is 0): set it, e.g. `eval: {interval: 100}`, for a held-out loss")
    return None


def held_out_repeats(source, reads: int) -> str | None:
    """A line when an evaluation of ``reads`` held-out samples (``eval.batches`` global
    batches) reads some source's held-out samples more than once: its loss is then a mean over
    fewer distinct samples than the batches suggest, the repeated ones counted several times."""
    held = getattr(source, "held_out", None)
    if not isinstance(held, BlendedSamples) or reads <= 0:
        return None
    source, _ = held.mixture.locate(np.arange(reads, dtype=np.int64))
    read = np.bincount(source, minlength=len(held.parts))
    over = [f"{p.dataset.url}: {int(read[i]):,} reads of {p.packed.count:,} samples"
            for i, p in enumerate(held.parts) if read[i] > p.packed.count]
    if not over:
        return None
    return (f"each evaluation reads {reads:,} held-out samples, and some sources hold fewer "
            f"than their share ({'; '.join(over)}): those are read more than once, and the "
            "held-out loss weighs them more (raise eval_fraction, or lower "
            "training.eval.batches)")
