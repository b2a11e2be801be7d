"""Token sources: a memory-mapped token file and a learnable synthetic stream.

Both are pure functions of a global sample index, so every layout sees exactly the same global
batch at every step (the numerics tests rely on it) and resuming needs no state beyond the number
of samples consumed. Sample k of step t for DP rank d, micro-batch j is global index
``t·B + d·(B/dp) + j·mb + i``: the union over ranks is always the same B sequences.

Only TP rank 0 of each group reads; it broadcasts to its TP peers (the paper removed these
redundant loaders). Under pipelining only the first stage needs inputs and only the last labels.
"""

from __future__ import annotations

import zlib
from dataclasses import dataclass

import numpy as np
import torch
import torch.distributed as dist

from mscale.config.records import DataSkips
from mscale.config.training import DataConfig
from mscale.train.data_check import check_token_file
from mscale.distributed.collectives import COMM_CLOCK
from mscale.errors import MscaleError


class TokenFile:
    """A flat array of uint16/uint32 tokens; sample k is tokens[k·s : k·s + s + 1]."""

    def __init__(self, path: str, dtype: str, seq_len: int, vocab: int):
        check_token_file(path, dtype)
        try:
            self.tokens = np.memmap(path, dtype=np.dtype(dtype), mode="r")
        except (OSError, ValueError) as e:
            raise MscaleError(f"cannot map the token file: {e}", file=path,
                              field="training.data.path",
                              fix="point data.path at a readable flat uint16/uint32 token file")
        self.seq_len = seq_len
        self.num_samples = (len(self.tokens) - 1) // seq_len
        if self.num_samples < 1:
            raise MscaleError(f"token file holds {len(self.tokens)} tokens, fewer than one "
                              f"sequence of {seq_len + 1}", file=path, field="training.data.path",
                              fix="use a larger token file or a shorter seq_len")
        top = int(self.tokens[: min(len(self.tokens), 1 << 20)].max())
        if top >= vocab:
            raise MscaleError(f"token id {top} >= vocab {vocab}", file=path,
                              field="training.data.dtype", fix="check the dtype and model.vocab")

    def sample(self, k: int) -> torch.Tensor:
        """Sequence k (wrapping around at the end of the file), s+1 tokens as int64."""
        k %= self.num_samples
        s = self.seq_len
        return torch.from_numpy(np.asarray(self.tokens[k * s: k * s + s + 1], dtype=np.int64))


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


def make_source(cfg: DataConfig, seed: int, seq_len: int, vocab: int):
    if cfg.kind == "tokens":
        assert cfg.path is not None
        return TokenFile(cfg.path, cfg.dtype, seq_len, vocab)
    return SyntheticTokens(seed, seq_len, vocab)


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
                 is_reader: bool = True, skips: DataSkips | None = None):
        self.source, self.plan = source, plan
        self.tp_group, self.tp_src, self.tp_size, self.is_reader = tp_group, tp_src, tp_size, is_reader
        self.skips = skips or DataSkips()
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
            batch = torch.stack([self.source.sample(k) for k in ids])
        else:
            batch = torch.empty(shape, dtype=torch.int64)
        if self.tp_size > 1:
            with COMM_CLOCK.timed("tp"):  # waiting for a late TP peer is communication, not I/O
                dist.broadcast(batch, src=self.tp_src, group=self.tp_group)
        return batch[:, :-1].contiguous(), batch[:, 1:].contiguous()


def source_fingerprint(source) -> int:
    """A short checksum of the first sample, recorded so that a resumed run can tell whether its
    data changed under it."""
    return zlib.crc32(source.sample(0).numpy().tobytes())
