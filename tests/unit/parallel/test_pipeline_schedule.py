"""The pipeline schedules as data: completeness, order, deadlock freedom, memory and bubble."""

import pytest

from mscale.parallel.pipeline.schedule import (Action, bubble_fraction, check_micro_batches,
                                               link_order, needs, owner, schedule, simulate,
                                               warmup_count)

# (pp, vpp, micro-batches): 1F1B at m = pp and m > pp, interleaved at m = pp and m = k·pp.
CASES = [(2, 1, 2), (2, 1, 5), (3, 1, 3), (4, 1, 4), (4, 1, 7), (8, 1, 16),
         (2, 2, 2), (2, 2, 6), (3, 2, 3), (4, 2, 4), (4, 2, 8), (4, 3, 12), (8, 2, 16)]


@pytest.mark.parametrize("pp,vpp,m", CASES)
def test_every_forward_and_backward_exactly_once_forward_first(pp, vpp, m):
    for rank in range(pp):
        acts = schedule(pp, vpp, m, rank)
        expected = {(k, mb, c) for k in "FB" for mb in range(m) for c in range(vpp)}
        assert sorted((a.kind, a.micro, a.chunk) for a in acts) == sorted(expected)
        seen = set()
        for a in acts:
            if not a.forward:
                assert ("F", a.micro, a.chunk) in seen, f"rank {rank}: {a} before its forward"
            seen.add((a.kind, a.micro, a.chunk))


@pytest.mark.parametrize("pp,vpp,m", CASES)
def test_chunks_see_micro_batches_in_order(pp, vpp, m):
    """The DP reduction of a chunk starts on its backward of micro-batch m-1: that must be the
    chunk's last backward."""
    for rank in range(pp):
        for c in range(vpp):
            for kind in "FB":
                order = [a.micro for a in schedule(pp, vpp, m, rank) if a.kind == kind and a.chunk == c]
                assert order == list(range(m))


@pytest.mark.parametrize("pp,vpp,m", CASES)
def test_global_execution_has_no_deadlock(pp, vpp, m):
    timeline = simulate(pp, vpp, m)  # raises on deadlock
    assert all(len(t) == 2 * m * vpp for t in timeline)


@pytest.mark.parametrize("pp,vpp,m", CASES)
def test_receives_posted_in_consumption_order_match_send_order(pp, vpp, m):
    """Each link's messages are consumed in the order they are sent, so posting receives in a
    rank's own order is correct even on a transport that matches by order only (NCCL)."""
    for dst in range(pp):
        consumed: dict[int, list] = {}
        for a in schedule(pp, vpp, m, dst):
            msg = needs(a, dst, pp, vpp)
            if msg is not None:
                consumed.setdefault(owner(msg.src, pp)[0], []).append(msg)
        for src, msgs in consumed.items():
            assert tuple(msgs) == link_order(pp, vpp, m, src, dst)


def test_warmup_counts_match_megatron():
    assert [warmup_count(4, 1, 8, r) for r in range(4)] == [3, 2, 1, 0]
    assert [warmup_count(4, 2, 8, r) for r in range(4)] == [10, 8, 6, 4]
    assert warmup_count(4, 2, 4, 0) == 8  # capped at m·vpp
    acts = schedule(4, 1, 8, 1)
    assert [a.kind for a in acts[:5]] == ["F", "F", "F", "B", "F"]


def test_interleaved_order_matches_megatron():
    assert schedule(2, 2, 4, 1)[:8] == (
        Action("F", 0, 0), Action("F", 1, 0), Action("F", 0, 1), Action("B", 0, 1),
        Action("F", 1, 1), Action("B", 1, 1), Action("F", 2, 0), Action("B", 0, 0))


@pytest.mark.parametrize("pp,m", [(2, 2), (4, 4), (4, 9), (8, 16)])
def test_1f1b_peak_in_flight_activations_at_most_pp(pp, m):
    for rank in range(pp):
        live = peak = 0
        for a in schedule(pp, 1, m, rank):
            live += 1 if a.forward else -1
            peak = max(peak, live)
        assert peak == min(pp - rank, m)


@pytest.mark.parametrize("pp,m", [(2, 2), (2, 8), (4, 4), (4, 8), (8, 32)])
def test_1f1b_bubble_is_p_minus_1_over_m_plus_p_minus_1(pp, m):
    assert bubble_fraction(simulate(pp, 1, m, 1.0, 2.0)) == pytest.approx((pp - 1) / (m + pp - 1))


@pytest.mark.parametrize("pp,vpp,m", [(2, 2, 4), (4, 2, 8), (4, 3, 8), (4, 4, 16)])
def test_interleaving_divides_the_bubble_by_vpp(pp, vpp, m):
    ideal = (pp - 1) / (vpp * m)  # bubble / ideal compute (Narayanan et al. 2021, §2.2)
    frac = bubble_fraction(simulate(pp, vpp, m, 1.0 / vpp, 2.0 / vpp))
    assert frac == pytest.approx(ideal / (1 + ideal))
    assert frac < bubble_fraction(simulate(pp, 1, m, 1.0, 2.0))


def test_refuses_too_few_micro_batches():
    assert "cannot fill" in check_micro_batches(4, 1, 3)
    assert "divisible" in check_micro_batches(4, 2, 6)
    assert check_micro_batches(4, 2, 8) is None
    with pytest.raises(ValueError, match="cannot fill"):
        schedule(4, 1, 2, 0)
