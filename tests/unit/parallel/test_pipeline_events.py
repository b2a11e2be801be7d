"""The runner and the eval pass post, wait and compute in exactly the order their plan prescribes.

`posting.replay_nccl` proves a plan deadlock-free for one host order per rank: ``plan[0]``, then
for each action k the wait for its input, its compute, ``plan[k + 1]``; at the end the wait for
the sends. The proof covers the engine only if the engine runs that order. Comparing the flat
list of batches is not enough: a batch posted before the action it should follow, or a wait
moved ahead of the post it needs, leaves that list unchanged and changes what NCCL sees. So each
rank runs here, without a process group, on a link that logs every batch and every wait, with
chunks that log every forward and backward, and the log must equal the prescribed sequence,
event for event.
"""

import contextlib

import pytest
import torch

from mscale.parallel.pipeline import runner
from mscale.parallel.pipeline.forward_only import run_pipeline_forward
from mscale.parallel.pipeline.p2p import PlanWalker
from mscale.parallel.pipeline.posting import (Batch, PostingError, forward_only_actions,
                                              forward_only_plan, posting_plan)
from mscale.parallel.pipeline.runner import PipelineStage, PipelineStep
from mscale.parallel.pipeline.schedule import Message, needs, schedule

SHAPE = (2, 1, 3)
# 1F1B (warm-up longer than, equal to and shorter than the steady state) and interleaved
CASES = [(2, 1, 2), (2, 1, 5), (4, 1, 4), (4, 1, 7), (2, 2, 4), (3, 2, 6), (2, 3, 4), (4, 2, 8)]


class RecordingLink:
    """`p2p.StageLink`'s contract without a transport: logs each batch it posts (nothing for an
    empty one) and each wait, and refuses what the real link refuses."""

    def __init__(self, log: list, pp: int = 1):
        self.log, self.pending, self.pp = log, set(), pp

    def post(self, sends, recvs):
        assert all(t.shape == SHAPE and t.dtype == torch.float32 for _, t in sends)
        for msg, t in sends:  # an activation is the output of its micro-batch and chunk
            if msg.kind == "act":
                assert int(t.flatten()[0]) == _stamp(msg.micro, msg.src // self.pp), \
                    f"{msg} sent another output"
        assert not self.pending & set(recvs), "a receive posted twice"
        if sends or recvs:
            self.log.append(("post", Batch(tuple(m for m, _ in sends), tuple(recvs))))
        self.pending.update(recvs)

    def wait(self, msg: Message) -> torch.Tensor:
        assert msg in self.pending, f"waiting for {msg}, never posted"
        self.pending.remove(msg)
        self.log.append(("wait", msg))
        return torch.full(SHAPE, float(msg.micro))  # the chunk reads its micro-batch from it

    def reap(self):
        pass  # releases finished sends: no communication, not an event

    def drain(self):
        assert not self.pending, f"receives never waited for: {self.pending}"
        self.log.append(("drain",))


class Chunk(torch.nn.Module):
    """Logs ``(kind, micro, chunk)`` as its forward runs and as its backward reaches it; the
    micro-batch comes with the input (token ids or a received activation filled with it)."""

    def __init__(self, chunk: int, log: list):
        super().__init__()
        self.chunk, self.log = chunk, log
        self.w = torch.nn.Parameter(torch.ones(SHAPE[-1]))

    def forward(self, x, labels=None):
        micro = int(x.flatten()[0]) % STAMP
        self.log.append(("F", micro, self.chunk))
        x = x if x.is_floating_point() else x[..., None].float()
        h = x * self.w + (_stamp(micro, self.chunk) - x.detach())  # the value: its stamp
        if h.requires_grad:  # training: the backward of this chunk starts at h
            h.register_hook(lambda _: self.log.append(("B", micro, self.chunk)))
        return h.sum() if labels is not None else h


STAMP = 1000
"""An output's value is ``_stamp(micro, chunk)``: a send of another output is seen."""


def _stamp(micro: int, chunk: int) -> int:
    return micro + STAMP * (chunk + 1)


def _tokens(micro: int):
    return (torch.full(SHAPE[:2], micro, dtype=torch.long),) * 2


class _Null:
    """The gradient buffer, precision and timer: contexts that do nothing."""

    def __getattr__(self, name):
        return lambda *a, **k: contextlib.nullcontext()


def _stage(pp: int, vpp: int, m: int, rank: int, log: list) -> PipelineStage:
    return PipelineStage(chunks=[Chunk(c, log) for c in range(vpp)], pp=pp, vpp=vpp,
                         pp_rank=rank, micro_batches=m, device=torch.device("cpu"),
                         link=RecordingLink(log, pp), get_batch=lambda step, micro: _tokens(micro),
                         grads=_Null(), precision=_Null())


def prescribed(plan, actions, pp: int, vpp: int, rank: int) -> list:
    """The host order `replay_nccl` proves: ``plan[0]``; per action k, the wait for its input,
    its compute, ``plan[k + 1]``; then the wait for the sends."""
    events = [("post", b) for b in plan[0] if b]
    for k, a in enumerate(actions):
        msg = needs(a, rank, pp, vpp)
        events += [("wait", msg)] if msg is not None else []
        events.append((a.kind, a.micro, a.chunk))
        events += [("post", b) for b in plan[k + 1] if b]
    return events + [("drain",)]


def _train(pp, vpp, m, rank) -> list:
    log = []
    PipelineStep(_stage(pp, vpp, m, rank, log), 0, _Null()).run()
    return log


def _evaluate(pp, vpp, m, rank) -> list:
    log = []
    run_pipeline_forward(_stage(pp, vpp, m, rank, log), _tokens, m)
    return log


@pytest.mark.parametrize("pp,vpp,m", CASES)
def test_training_step_runs_the_plan_event_for_event(pp, vpp, m):
    for rank in range(pp):
        want = prescribed(posting_plan(pp, vpp, m, rank), schedule(pp, vpp, m, rank),
                          pp, vpp, rank)
        assert _train(pp, vpp, m, rank) == want, f"rank {rank}"


@pytest.mark.parametrize("pp,vpp,m", CASES)
def test_eval_pass_runs_the_plan_event_for_event(pp, vpp, m):
    for rank in range(pp):
        want = prescribed(forward_only_plan(pp, vpp, m, rank),
                          forward_only_actions(pp, vpp, m, rank), pp, vpp, rank)
        assert _evaluate(pp, vpp, m, rank) == want, f"rank {rank}"


def test_posting_points_count_not_only_the_batches():
    """What a flat list of batches misses: every entry posted one action early lists the same
    batches, and is a different sequence."""
    pp, vpp, m, rank = 2, 2, 4, 0
    plan, acts = posting_plan(pp, vpp, m, rank), schedule(pp, vpp, m, rank)
    early = (plan[0] + plan[1],) + plan[2:] + ((),)
    assert [b for e in early for b in e] == [b for e in plan for b in e]
    assert prescribed(early, acts, pp, vpp, rank) != _train(pp, vpp, m, rank)


# --- a receive the plan did not post is an error, never an extra batch ---------------------------

def test_a_step_whose_plan_posts_a_receive_after_its_use_fails_without_posting_it(monkeypatch):
    """Rank 1 of pp 2 receives activation 0 first; a plan that posts it after action 0 must stop
    the step at action 0's wait, with nothing posted beyond the plan."""
    def late(pp, vpp, m, rank):
        plan = posting_plan(pp, vpp, m, rank)
        return ((),) + ((plan[0] + plan[1]),) + plan[2:]

    monkeypatch.setattr(runner, "posting_plan", late)
    log = []
    with pytest.raises(PostingError, match="before the plan posted its receive"):
        PipelineStep(_stage(2, 1, 2, 1, log), 0, _Null()).run()
    assert log == []


def test_the_walker_refuses_unposted_waits_unsent_outputs_and_unposted_entries():
    act0 = Message("act", 0, 0, 1)
    log = []
    walker = PlanWalker(RecordingLink(log), ((), (Batch(recvs=(act0,)),)))
    walker.post_next()
    with pytest.raises(PostingError, match="before the plan posted"):
        walker.wait(act0)
    with pytest.raises(PostingError, match="1 plan entries never posted"):
        walker.finish()
    walker.post_next(Message("act", 0, 1, 2), torch.zeros(SHAPE))  # an output no batch sends
    assert walker.wait(act0).shape == SHAPE
    with pytest.raises(RuntimeError, match="outputs never sent"):
        walker.finish()
    assert log == [("post", Batch(recvs=(act0,))), ("wait", act0), ("drain",)]
