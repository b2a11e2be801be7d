"""Pipeline schedules as data: the ordered forward/backward actions of every rank.

Pure functions of (pp, vpp, micro-batches, rank), no processes, so the properties that matter
(every micro-batch runs once per chunk, forwards precede backwards, the ranks cannot deadlock,
the bubble is what the paper says) are proven by unit tests before any process is spawned.

Virtual stages follow Megatron: rank ``r`` holds chunks ``c = 0..vpp-1`` of virtual stages
``c·pp + r``, so a micro-batch visits rank 0, 1, …, pp-1, then rank 0 again for chunk 1, and so
on. 1F1B is interleaved 1F1B with vpp = 1.

Messages between ranks are described here too (`Message`): which activation or gradient an action
needs from another rank and which one it produces. Every rank can compute every other rank's
schedule, so a receiver knows the exact order in which its peer sends on each link and posts its
receives in that order (`link_order`): point-to-point matching is then correct even on transports
that match purely by order (NCCL), not only by tag (gloo).
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from functools import lru_cache


@dataclass(frozen=True)
class Action:
    """Run the forward (``"F"``) or backward (``"B"``) of one micro-batch on one local chunk."""

    kind: str
    micro: int
    chunk: int

    @property
    def forward(self) -> bool:
        return self.kind == "F"

    def __repr__(self) -> str:
        return f"{self.kind}{self.micro}.{self.chunk}"


@dataclass(frozen=True)
class Message:
    """An activation (``"act"``) or gradient (``"grad"``) of ``micro`` entering virtual stage
    ``dst`` (the stage that consumes it) from virtual stage ``src``."""

    kind: str
    micro: int
    src: int
    dst: int

    def tag(self, stages: int) -> int:
        """A tag unique within a step, so a tag-matching transport can never swap two tensors of
        the same shape (activations and gradients both are ``[s, b, h]``)."""
        return (self.micro * stages + self.dst) * 2 + (self.kind == "grad")


def virtual_stage(rank: int, chunk: int, pp: int) -> int:
    return chunk * pp + rank


def owner(vstage: int, pp: int) -> tuple[int, int]:
    """(rank, local chunk) holding a virtual stage."""
    return vstage % pp, vstage // pp


def check_micro_batches(pp: int, vpp: int, m: int) -> str | None:
    """Why ``m`` micro-batches cannot run on this pipeline, or None when they can."""
    if m < pp:
        return f"{m} micro-batches < pp={pp} stages: 1F1B cannot fill the pipeline"
    if vpp > 1 and m % pp:
        return f"interleaved 1F1B needs micro-batches ({m}) divisible by pp={pp}"
    return None


def warmup_count(pp: int, vpp: int, m: int, rank: int) -> int:
    """Forwards a rank runs before its first backward (Megatron's counts).

    1F1B: ``pp - rank - 1``. Interleaved: ``2·(pp - rank - 1) + (vpp - 1)·pp``: the extra pp per
    additional chunk fills the other chunks, the doubled rank term lets rank r's first backward
    find its gradient already computed. Capped at the total number of forwards.
    """
    if vpp == 1:
        return min(pp - rank - 1, m)
    return min(2 * (pp - rank - 1) + (vpp - 1) * pp, m * vpp)


def _interleaved_slot(k: int, pp: int, vpp: int, forward: bool) -> tuple[int, int]:
    """(micro, chunk) of the k-th forward or backward of a rank: groups of pp micro-batches go
    through chunk 0..vpp-1 (forward) or vpp-1..0 (backward) before the next group starts."""
    group, pos = divmod(k, pp * vpp)
    chunk = pos // pp
    return group * pp + pos % pp, chunk if forward else vpp - 1 - chunk


@lru_cache(maxsize=256)
def schedule(pp: int, vpp: int, m: int, rank: int) -> tuple[Action, ...]:
    """The actions of ``rank``: warm-up forwards, then one forward and one backward alternately
    (steady state), then the remaining backwards (cool-down)."""
    reason = check_micro_batches(pp, vpp, m)
    if reason:
        raise ValueError(reason)
    total = m * vpp
    warm = warmup_count(pp, vpp, m, rank)

    def f(k: int) -> Action:
        micro, chunk = _interleaved_slot(k, pp, vpp, True)
        return Action("F", micro, chunk)

    def b(k: int) -> Action:
        micro, chunk = _interleaved_slot(k, pp, vpp, False)
        return Action("B", micro, chunk)

    out = [f(k) for k in range(warm)]
    for i in range(total - warm):
        out += [f(warm + i), b(i)]
    out += [b(k) for k in range(total - warm, total)]
    return tuple(out)


def needs(action: Action, rank: int, pp: int, vpp: int) -> Message | None:
    """The message an action must receive before it can run (None: its input is local)."""
    vs = virtual_stage(rank, action.chunk, pp)
    if action.forward:
        return Message("act", action.micro, vs - 1, vs) if vs > 0 else None
    return Message("grad", action.micro, vs + 1, vs) if vs < pp * vpp - 1 else None


def produces(action: Action, rank: int, pp: int, vpp: int) -> Message | None:
    """The message an action sends when it is done (None: nothing leaves the chunk)."""
    vs = virtual_stage(rank, action.chunk, pp)
    if action.forward:
        return Message("act", action.micro, vs, vs + 1) if vs < pp * vpp - 1 else None
    return Message("grad", action.micro, vs, vs - 1) if vs > 0 else None


@lru_cache(maxsize=256)
def link_order(pp: int, vpp: int, m: int, src_rank: int, dst_rank: int) -> tuple[Message, ...]:
    """The messages ``src_rank`` sends to ``dst_rank`` during a step, in the order it sends them."""
    out = []
    for a in schedule(pp, vpp, m, src_rank):
        msg = produces(a, src_rank, pp, vpp)
        if msg is not None and owner(msg.dst, pp)[0] == dst_rank:
            out.append(msg)
    return tuple(out)


def phases(actions: tuple[Action, ...]) -> tuple[int, int]:
    """(index of the first backward, index of the last forward): before the first is the warm-up
    (pipeline filling), after the last is the cool-down (draining)."""
    first_b = next(i for i, a in enumerate(actions) if not a.forward)
    last_f = max(i for i, a in enumerate(actions) if a.forward)
    return first_b, last_f


def simulate(pp: int, vpp: int, m: int, t_f: float | Sequence[float] = 1.0,
             t_b: float | Sequence[float] = 2.0,
             latency: float = 0.0) -> list[list[tuple[Action, float, float]]]:
    """Execute all ranks' schedules against each other with fixed costs per chunk action
    (``t_f``/``t_b``: one cost for every rank, or one per rank).

    Sends never block (messages are buffered, as with asynchronous isend), so a rank waits only
    for the message its next action needs. Returns, per rank, (action, start, end). Raises
    RuntimeError naming the blocked actions if no rank can proceed: a deadlock.
    """
    scheds = [schedule(pp, vpp, m, r) for r in range(pp)]
    t_f = [float(t_f)] * pp if isinstance(t_f, (int, float)) else list(t_f)
    t_b = [float(t_b)] * pp if isinstance(t_b, (int, float)) else list(t_b)
    pos, clock = [0] * pp, [0.0] * pp
    arrived: dict[Message, float] = {}
    out: list[list[tuple[Action, float, float]]] = [[] for _ in range(pp)]
    while any(pos[r] < len(scheds[r]) for r in range(pp)):
        progressed = False
        for r in range(pp):
            while pos[r] < len(scheds[r]):
                a = scheds[r][pos[r]]
                need = needs(a, r, pp, vpp)
                if need is not None and need not in arrived:
                    break
                start = max(clock[r], arrived.get(need, 0.0))
                clock[r] = start + (t_f[r] if a.forward else t_b[r])
                out[r].append((a, start, clock[r]))
                sent = produces(a, r, pp, vpp)
                if sent is not None:
                    arrived[sent] = clock[r] + latency
                pos[r] += 1
                progressed = True
        if not progressed:
            blocked = {r: scheds[r][pos[r]] for r in range(pp) if pos[r] < len(scheds[r])}
            raise RuntimeError(f"pipeline deadlock: blocked actions {blocked}")
    return out


def bubble_fraction(timeline: list[list[tuple[Action, float, float]]]) -> float:
    """Idle share of the step, averaged over ranks (step = the latest end on any rank)."""
    step = max(t[-1][2] for t in timeline)
    busy = sum(end - start for t in timeline for _, start, end in t)
    return 1.0 - busy / (step * len(timeline))
