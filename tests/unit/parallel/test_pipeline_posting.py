"""The pipeline's point-to-point posting order, replayed under NCCL's rules (posting.py).

NCCL runs every batch of the PP communicator on one stream, in issue order, each batch finishing
only when all its operations have met their peers', and pairs messages by order; gloo does
neither, so only this replay, not the gloo tests, can show that an order hangs on GPUs. That the
runner and the eval pass post these plans, in the host order the replay assumes, is
test_pipeline_events.py.
"""

import pytest

from mscale.parallel.pipeline.posting import (Batch, PostingError, forward_only_actions,
                                              forward_only_plan, posting_plan, replay_nccl)
from mscale.parallel.pipeline.schedule import (Message, check_micro_batches, needs, phases,
                                               produces, schedule, simulate)

GRID = [(pp, vpp, m) for pp in range(2, 9) for vpp in range(1, 5) for m in range(1, 17)
        if check_micro_batches(pp, vpp, m) is None]


def _step(timeline) -> float:
    return max(t[-1][2] for t in timeline)


def old_plan(pp, vpp, m, rank):
    """The order the runner posted before: the receives of actions 0 and 1 up front, then per
    action k one batch with k's send and the receive of action k+2. Fine on gloo, hangs on NCCL."""
    acts = schedule(pp, vpp, m, rank)

    def need(k):
        return needs(acts[k], rank, pp, vpp) if k < len(acts) else None

    def batch(sends, recvs):
        b = Batch(tuple(s for s in sends if s), tuple(r for r in recvs if r))
        return (b,) if b else ()

    return (batch([], [need(0), need(1)]),) + tuple(
        batch([produces(a, rank, pp, vpp)], [need(k + 2)]) for k, a in enumerate(acts))


@pytest.mark.parametrize("pp", range(2, 9))
def test_every_layout_up_to_pp8_vpp4_m16_cannot_hang_under_nccl(pp):
    """Training (1F1B and interleaved) and the eval pass, every valid (vpp ≤ 4, m ≤ 16); at zero
    transfer time the order costs no step time against the buffered simulation."""
    for _, vpp, m in [c for c in GRID if c[0] == pp]:
        timeline = replay_nccl(pp, vpp, m)  # raises PostingError on a hang or a mis-pairing
        assert all(len(t) == 2 * m * vpp for t in timeline)
        assert _step(timeline) == _step(simulate(pp, vpp, m)), (pp, vpp, m)
        replay_nccl(pp, vpp, m, plan=forward_only_plan, actions=forward_only_actions)


@pytest.mark.parametrize("pp,vpp,m", [(16, 1, 64), (12, 2, 48), (16, 4, 32)])
def test_larger_pipelines_cannot_hang_either(pp, vpp, m):
    replay_nccl(pp, vpp, m)


@pytest.mark.parametrize("pp,vpp,m", [c for c in GRID if c[2] in (c[0], 2 * c[0]) or c[2] == 13])
def test_the_old_order_hangs_under_nccl(pp, vpp, m):
    """The checker can fail: the previous posting order hangs for every layout."""
    with pytest.raises(PostingError, match="deadlock"):
        replay_nccl(pp, vpp, m, plan=old_plan)


def test_the_reviewers_two_stage_example_hangs_and_megatrons_pairing_does_not():
    """pp 2, m 2 (rank 0: F0 F1 B0 B1; rank 1: F0 B0 F1 B1), written out by hand. Rank 0's first
    batch waits for grad 0, which rank 1 sends only after its prefetched receive of act 1, which
    waits for rank 0's second batch, queued behind the first."""
    act = [Message("act", i, 0, 1) for i in range(2)]
    grad = [Message("grad", i, 1, 0) for i in range(2)]

    def plan(hand):
        return lambda pp, vpp, m, rank: hand[rank]

    B = Batch
    hangs = {0: [(), (B((act[0],), (grad[0],)),), (B((act[1],), (grad[1],)),), (), ()],
             1: [(B(recvs=(act[0],)),), (B(recvs=(act[1],)),), (B(sends=(grad[0],)),), (),
                 (B(sends=(grad[1],)),)]}
    with pytest.raises(PostingError, match=r"rank 0 batch 0 .*rank 1 batch 1"):
        replay_nccl(2, 1, 2, plan=plan(hangs))
    # send_forward_recv_backward on rank 0 ↔ send_backward_recv_forward on rank 1
    pairs = {0: [(), (B((act[0],)),), (B((act[1],), (grad[0],)),), (B(recvs=(grad[1],)),), ()],
             1: [(B(recvs=(act[0],)),), (), (B((grad[0],), (act[1],)),), (),
                 (B(sends=(grad[1],)),)]}
    replay_nccl(2, 1, 2, plan=plan(pairs))
    assert {r: [b for e in posting_plan(2, 1, 2, r) for b in e] for r in (0, 1)} == \
        {r: [b for e in pairs[r] for b in e] for r in (0, 1)}


def test_order_matching_pairs_by_position_not_by_tag():
    """Rank 1 posts its first two activation receives up front, the second first: NCCL would hand
    activation 0 to the receive of activation 1 (gloo's tags would hide it)."""
    act0, act1 = Message("act", 0, 0, 1), Message("act", 1, 0, 1)

    def swapped(pp, vpp, m, rank):
        plan = posting_plan(pp, vpp, m, rank)
        if rank != 1:
            return plan
        drop = [tuple(Batch(b.sends, tuple(r for r in b.recvs if r != act1)) for b in e)
                for e in plan]
        assert plan[0] == (Batch(recvs=(act0,)),) and drop != list(plan)
        return [(Batch(recvs=(act1, act0)),)] + drop[1:]

    with pytest.raises(PostingError, match=r"send of act 0 .* receive of act 1 .*pairs by order"):
        replay_nccl(4, 1, 4, plan=swapped)


def test_a_receive_posted_after_its_use_is_refused():
    def late(pp, vpp, m, rank):
        plan = [list(e) for e in posting_plan(pp, vpp, m, rank)]
        if rank == 1:
            plan[1] += plan[0]
            plan[0] = []
        return plan
    with pytest.raises(PostingError, match="not received before it"):
        replay_nccl(2, 1, 2, plan=late)


@pytest.mark.parametrize("pp,vpp,m", [(2, 2, 4), (4, 2, 8), (4, 3, 12), (8, 4, 16)])
def test_interleaved_steady_state_receives_overlap_one_action(pp, vpp, m):
    """Under interleaving every receive of the steady state is posted at least one action before
    the action that needs it, so its transfer overlaps that action's compute."""
    for rank in range(pp):
        acts, plan = schedule(pp, vpp, m, rank), posting_plan(pp, vpp, m, rank)
        posted = {msg: i for i, entry in enumerate(plan) for b in entry for msg in b.recvs}
        first_b, last_f = phases(acts)
        for k in range(first_b + 1, last_f + 1):
            msg = needs(acts[k], rank, pp, vpp)
            if msg is not None:
                assert posted[msg] <= k - 1, (rank, k, acts[k])  # plan[i]: after action i-1


@pytest.mark.parametrize("pp,vpp,m,latency", [(4, 2, 8, 0.1), (8, 2, 16, 0.1), (2, 2, 8, 0.5)])
def test_interleaved_transfers_hide_behind_compute(pp, vpp, m, latency):
    """With a transfer time the NCCL replay of the interleaved order matches the buffered
    simulation, where a transfer never waits for its receiver (measured when written)."""
    kw = dict(t_f=1.0 / vpp, t_b=2.0 / vpp, latency=latency)
    assert _step(replay_nccl(pp, vpp, m, **kw)) == pytest.approx(_step(simulate(pp, vpp, m, **kw)))

