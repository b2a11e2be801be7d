"""Activation and gradient transfer between neighbouring pipeline stages.

Every transfer is asynchronous (``batch_isend_irecv``), and what goes into each batch, and when, is
the caller's posting plan (`posting.posting_plan` for training, `posting.forward_only_plan` for
eval), walked by `PlanWalker`: the link posts exactly the batches it is given, in the order it is
given them, and never posts anything on its own, because under NCCL the order of batches on the PP
communicator is what decides whether the ranks hang (posting.py, docs/pipeline.md). Sends are left
in flight while the rank computes on; a send's tensor is held only until the send completes (`reap`
drops finished ones), so an activation is freed as soon as its backward has run and its gradient
has left.

No shape handshake: every tensor crossing a stage boundary is the residual stream of one
micro-batch, ``[s, b, h]`` (``[s/tp, b, h]`` under sequence parallelism), in fp32 (the residual
stream stays fp32 under bf16 autocast: the embedding output is fp32 and each block adds its
output to it), so both sides know the shape from the config alone.

Peers are addressed by global rank through ``pp_ranks`` (stage order) on the PP group; every
message has a tag unique within a step, and the plans pair each link's sends and receives in the
same order (`posting.replay_nccl` checks it), so the pairing is right whether the transport
matches by tag (gloo) or by order (NCCL).
"""

from __future__ import annotations

import torch
import torch.distributed as dist

from collections.abc import Sequence

from mscale.parallel.pipeline.posting import Batch, PostingError, describe
from mscale.parallel.pipeline.schedule import Message, owner


def boundary_shape(plan, tp_size: int, sequence_parallel: bool) -> tuple[int, int, int]:
    """Shape of the hidden states one micro-batch carries between stages on this rank."""
    s = plan.model.seq_len
    if sequence_parallel and tp_size > 1:
        s //= tp_size
    return (s, plan.layout.micro_batch, plan.model.hidden)


class StageLink:
    """One rank's in-flight receives and sends with the other stages of its pipeline."""

    def __init__(self, group: dist.ProcessGroup, pp_ranks: list[int], vpp: int,
                 shape: tuple[int, ...], device: torch.device, dtype: torch.dtype = torch.float32):
        self.group, self.pp_ranks = group, pp_ranks
        self.pp, self.stages = len(pp_ranks), len(pp_ranks) * vpp
        self.shape, self.device, self.dtype = shape, device, dtype
        self._recvs: dict[Message, tuple[dist.Work, torch.Tensor]] = {}
        self._sends: list[tuple[dist.Work, torch.Tensor]] = []

    def _peer(self, vstage: int) -> int:
        return self.pp_ranks[owner(vstage, self.pp)[0]]

    def post(self, sends: list[tuple[Message, torch.Tensor]], recvs: list[Message]) -> None:
        """Start sends and receives in one batch, in this order (nothing posted when both are
        empty)."""
        ops, new = [], []
        for msg, t in sends:
            if t.shape != self.shape or t.dtype != self.dtype:
                raise RuntimeError(f"stage boundary tensor {tuple(t.shape)} {t.dtype} is not the "
                                   f"expected {self.shape} {self.dtype}: the model's layout changed")
            t = t.detach().contiguous()
            ops.append(dist.P2POp(dist.isend, t, self._peer(msg.dst), self.group, msg.tag(self.stages)))
            new.append((None, t))
        for msg in recvs:
            if msg in self._recvs:
                raise RuntimeError(f"receive of {msg} posted twice: the posting plan is wrong")
            buf = torch.empty(self.shape, dtype=self.dtype, device=self.device)
            ops.append(dist.P2POp(dist.irecv, buf, self._peer(msg.src), self.group, msg.tag(self.stages)))
            new.append((msg, buf))
        if not ops:
            return
        works = dist.batch_isend_irecv(ops)
        if len(works) == 1 < len(ops):  # NCCL coalesces a batch into one request
            works = works * len(ops)
        for work, (msg, t) in zip(works, new):
            if msg is None:
                self._sends.append((work, t))
            else:
                self._recvs[msg] = (work, t)

    def wait(self, msg: Message) -> torch.Tensor:
        """Block until ``msg`` has arrived and hand over its buffer. Its receive must have been
        posted: posting it here would put a batch on the stream that no plan accounts for.
        Under NCCL this waits for the receive's whole batch (one coalesced work)."""
        if msg not in self._recvs:
            raise RuntimeError(f"waiting for {msg}, whose receive was never posted: the posting "
                               "plan is wrong")
        work, buf = self._recvs.pop(msg)
        work.wait()
        return buf

    def reap(self) -> None:
        """Forget sends that have completed, releasing their tensors."""
        self._sends = [(w, t) for w, t in self._sends if not w.is_completed()]

    def drain(self) -> None:
        """Wait for every send; a step ends with nothing in flight."""
        for work, _ in self._sends:
            work.wait()
        self._sends = []
        if self._recvs:
            raise RuntimeError(f"receives posted but never used: {sorted(self._recvs, key=repr)}")


class PlanWalker:
    """Posts one rank's posting plan on its link, entry by entry, and hands each action its input.

    The host order is the one `posting.replay_nccl` proves: ``plan[0]`` before the first action,
    then per action k its input (`wait`) and, once its output is computed, ``plan[k + 1]``
    (`post_next`). The walker posts only the plan's batches, so an action may only wait for a
    receive the plan has already posted: anything else would need a batch no replay accounted
    for, and is refused instead. Used by the training step (runner.py) and the eval pass
    (forward_only.py); the caller times the calls (pipeline communication, see runner.py).
    """

    def __init__(self, link: StageLink, plan: Sequence[Sequence[Batch]]):
        self.link, self.plan = link, plan
        self.entry = 0
        """The next plan entry to post."""
        self.outbox: dict[Message, torch.Tensor] = {}
        """Outputs computed and not yet handed to a batch (the plans send each right away)."""
        self.expected: set[Message] = set()
        """Receives the plan has posted and no action has waited for yet."""

    def post_next(self, sent: Message | None = None, out: torch.Tensor | None = None) -> None:
        """Post the next plan entry's batches, in order; ``sent`` is the output ``out`` of the
        action just run, if it leaves this rank. Finished sends are released after."""
        if sent is not None:
            self.outbox[sent] = out
        for batch in self.plan[self.entry]:
            self.link.post([(msg, self.outbox.pop(msg)) for msg in batch.sends],
                           list(batch.recvs))
            self.expected.update(batch.recvs)
        self.entry += 1
        self.link.reap()

    def wait(self, msg: Message) -> torch.Tensor:
        """Block until ``msg``, whose receive the plan has posted, has arrived; its buffer."""
        if msg not in self.expected:
            raise PostingError(f"waiting for {describe(msg)} before the plan posted its receive "
                               f"(entries 0..{self.entry - 1} posted): the posting plan is wrong")
        self.expected.remove(msg)
        return self.link.wait(msg)

    def finish(self) -> None:
        """Wait for every send: the step ends with the whole plan posted and nothing in flight."""
        if self.entry != len(self.plan):
            raise PostingError(f"{len(self.plan) - self.entry} plan entries never posted")
        self.link.drain()
        if self.outbox:
            raise RuntimeError(f"outputs never sent: {sorted(self.outbox, key=repr)}")
