"""What every rank posts to the PP communicator, and when: the order of its point-to-point
batches, as data, with a replay of all ranks' batches under NCCL's rules.

Pure Python, like `schedule`: the runner (runner.py) and the eval pass (forward_only.py) post
exactly the batches `posting_plan` / `forward_only_plan` list (through `p2p.PlanWalker`), and
`replay_nccl` proves those same lists deadlock-free, so the engine and the proof cannot drift
(tests/unit/parallel/test_pipeline_posting.py checks every (pp, vpp, m) up to pp 8, vpp 4, m 16;
test_pipeline_events.py that the runner and the eval pass post, wait and compute in exactly the
order the replay assumes).

Why the order matters (docs/pipeline.md, "Transfers and overlap"). Every ``batch_isend_irecv``
on NCCL is one ``ncclGroupStart``/``ncclGroupEnd`` group on the PP group's communicator
(torch/distributed/distributed_c10d.py ``batch_isend_irecv`` → ``_coalescing_manager``;
ProcessGroupNCCL ``pointToPoint`` picks the group-wide communicator for batched ops), and:

1. all groups on that communicator run on one NCCL stream, in issue order; a group is one
   kernel that completes only when all of its sends and receives have met their peers' (NCCL:
   "point-to-point calls within a group will be blocking until that group of calls completes");
   the next group on the stream cannot start before it. Each group also waits for the compute
   issued before it (ProcessGroupNCCL ``syncStream``), and a compute that waits on a batch's
   work waits for the whole group (one coalesced Work per batch).
2. Messages between two ranks match in issue order: the i-th send from A to B meets the i-th
   receive on B from A, whatever the tags (which only gloo honours).

Gloo has neither rule (each op completes on its own), so an order can pass every gloo test and
still hang under NCCL until the collective timeout.

The orders (`posting_plan`), each the pattern of a widely run implementation:

- 1F1B (vpp = 1): right after action k, one batch with k's send and the receive of action
  k+1; before the first action, the receive of action 0. In the steady state that is
  Megatron-LM's ``send_forward_recv_backward`` after a forward against the next rank's
  ``send_backward_recv_forward`` after its backward (torch.distributed.pipelining
  ``Schedule1F1B``: ``fwd_send_bwd_recv`` / ``bwd_send_fwd_recv``): each batch on one rank
  meets at most one batch of each neighbour, at the same action index in the steady state (in
  warm-up and cool-down, where a link carries one direction, the receiver's batch after its
  action k − 1).
- Interleaved 1F1B (vpp > 1): a forward posts one batch, its activation send with the receive
  of the rank's next forward; a backward one batch, its gradient send with the receive of the
  next backward; after the last warm-up forward, a batch with the receive of the first
  backward's gradient (Megatron-LM's interleaved schedule with ``overlap_p2p_comm``:
  ``send_forward_recv_forward`` / ``send_backward_recv_backward``). Megatron's warm-up of
  2·(p − r − 1) + (v − 1)·p forwards makes rank r's i-th batch of each direction meet rank
  r+1's (i−1)-th: one global round number orders every rank's batches. Each transfer then
  overlaps one action's compute (the backward between two forwards, and vice versa).

`replay_nccl` executes all ranks' batches and computes against each other under rules 1 and 2
(unbuffered sends: the strictest reading, and the one NCCL documents) and raises
`PostingError` on a hang, a mis-paired message or a receive posted after its use.
"""

from __future__ import annotations

from collections import deque
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from functools import lru_cache

from mscale.parallel.pipeline.schedule import (Action, Message, needs, owner, produces, schedule,
                                               warmup_count)


@dataclass(frozen=True)
class Batch:
    """One ``batch_isend_irecv``: sends (in order) and receives (in order), posted together."""

    sends: tuple[Message, ...] = ()
    recvs: tuple[Message, ...] = ()

    def __bool__(self) -> bool:
        return bool(self.sends or self.recvs)


Plan = tuple[tuple[Batch, ...], ...]
"""Per rank: ``plan[0]`` is posted before the first action, ``plan[k + 1]`` right after action
k's compute, each entry's batches in order."""


class PostingError(RuntimeError):
    """A posting plan that would hang, mis-pair messages or use a receive before posting it."""


def _batch(sends=(), recvs=()) -> tuple[Batch, ...]:
    b = Batch(tuple(s for s in sends if s is not None), tuple(r for r in recvs if r is not None))
    return (b,) if b else ()


@lru_cache(maxsize=256)
def posting_plan(pp: int, vpp: int, m: int, rank: int) -> Plan:
    """The batches ``rank`` posts during one training step (`schedule` order), see the module
    docstring: 1F1B sends each output with the next action's receive; interleaved 1F1B pairs
    sends and receives by direction."""
    acts = schedule(pp, vpp, m, rank)

    def need(k: int) -> Message | None:
        return needs(acts[k], rank, pp, vpp) if 0 <= k < len(acts) else None

    out: list[tuple[Batch, ...]] = [_batch(recvs=[need(0)])]
    if vpp == 1:
        for k, a in enumerate(acts):
            out.append(_batch([produces(a, rank, pp, vpp)], [need(k + 1)]))
        return tuple(out)
    # the index of the next forward / backward after each action
    next_f, next_b = [len(acts)] * len(acts), [len(acts)] * len(acts)
    for k in range(len(acts) - 2, -1, -1):
        later = acts[k + 1]
        next_f[k] = k + 1 if later.forward else next_f[k + 1]
        next_b[k] = k + 1 if not later.forward else next_b[k + 1]
    warm = warmup_count(pp, vpp, m, rank)
    first_b = next(k for k, a in enumerate(acts) if not a.forward)
    for k, a in enumerate(acts):
        sent = produces(a, rank, pp, vpp)
        entry = _batch([sent], [need(next_f[k] if a.forward else next_b[k])])
        if k == warm - 1:  # the first backward's gradient, in its own batch (Megatron)
            entry += _batch(recvs=[need(first_b)])
        out.append(entry)
    return tuple(out)


def forward_only_actions(pp: int, vpp: int, m: int, rank: int) -> tuple[Action, ...]:
    """The eval pass's order (forward_only.py): every (micro-batch, chunk) forward,
    lexicographically."""
    return tuple(Action("F", micro, chunk) for micro in range(m) for chunk in range(vpp))


@lru_cache(maxsize=64)
def forward_only_plan(pp: int, vpp: int, m: int, rank: int) -> Plan:
    """The eval pass's batches: each output's send with the next forward's receive. Each wait is
    on a pair earlier in the global order (micro, chunk, rank), so nothing can hang."""
    acts = forward_only_actions(pp, vpp, m, rank)

    def need(k: int) -> Message | None:
        return needs(acts[k], rank, pp, vpp) if k < len(acts) else None

    return (_batch(recvs=[need(0)]),) + tuple(
        _batch([produces(a, rank, pp, vpp)], [need(k + 1)]) for k, a in enumerate(acts))


def describe(msg: Message) -> str:
    return f"{msg.kind} {msg.micro} (stage {msg.src}→{msg.dst})"


def _describe_batch(b: Batch) -> str:
    return "[" + ", ".join([f"send {describe(s)}" for s in b.sends]
                           + [f"recv {describe(r)}" for r in b.recvs]) + "]"


PlanFn = Callable[[int, int, int, int], Sequence[Sequence[Batch]]]
ActionsFn = Callable[[int, int, int, int], Sequence[Action]]


def replay_nccl(pp: int, vpp: int, m: int, *, plan: PlanFn = posting_plan,
                actions: ActionsFn = schedule, t_f: float | Sequence[float] = 1.0,
                t_b: float | Sequence[float] = 2.0,
                latency: float = 0.0) -> list[list[tuple[Action, float, float]]]:
    """Run every rank's posted batches and computes against each other under NCCL's rules.

    Per rank, the host order is ``plan[0]``, action 0, ``plan[1]``, action 1, …; its batches
    form one stream. A batch starts when the batch before it on the stream has completed and the
    computes posted before it have ended; it completes when, for each of its operations, the
    peer's batch holding the matching operation has started (the two then run together; one
    ``latency`` per transfer, transfers in one batch concurrent): unbuffered, rendezvous sends.
    Matching is by order per (sender, receiver) pair and must pair identical messages. Action k
    starts when action k−1 has ended and the batch holding its input's receive has completed;
    it lasts ``t_f`` or ``t_b`` (one cost for every rank, or one per rank).

    Returns, per rank, (action, start, end) as `schedule.simulate` does. Raises `PostingError`
    if the ranks would hang (naming each rank's first batch that can never complete), if a
    send and the receive it meets carry different messages, if a message is sent before it is
    computed or never received, or if an action's input is not received before it.
    """
    t_f = [float(t_f)] * pp if isinstance(t_f, (int, float)) else [float(x) for x in t_f]
    t_b = [float(t_b)] * pp if isinstance(t_b, (int, float)) else [float(x) for x in t_b]
    acts = [tuple(actions(pp, vpp, m, r)) for r in range(pp)]
    posted = _Posted(pp)
    for r in range(pp):
        _post_rank(posted, r, plan(pp, vpp, m, r), acts[r], pp, vpp)
    peers = _pair(posted)
    return _timed(pp, vpp, acts, posted.batches, posted.before, posted.recv_at, peers, t_f, t_b,
                  latency)


class _Posted:
    """Every rank's batches as its host posts them, with what `_timed` and `_pair` need."""

    def __init__(self, pp: int):
        self.batches: list[list[Batch]] = [[] for _ in range(pp)]
        self.before: list[list[int]] = [[] for _ in range(pp)]  # actions computed before each
        self.recv_at: list[dict[Message, int]] = [{} for _ in range(pp)]  # message → batch
        self.sends: dict[tuple[int, int], list[tuple[Message, int]]] = {}  # (src, dst) → …
        self.recvs: dict[tuple[int, int], list[tuple[Message, int]]] = {}  # (message, batch)


def _post_rank(posted: _Posted, r: int, entries: Sequence[Sequence[Batch]],
               acts: Sequence[Action], pp: int, vpp: int) -> None:
    """Rank ``r``'s posting points (one before each action, one after the last) into
    ``posted``, checking that it sends only what it computed, once, receives each message once,
    and receives each action's input before it."""
    if len(entries) != len(acts) + 1:
        raise PostingError(f"rank {r}: {len(entries)} posting points for {len(acts)} "
                           "actions (want one before each action and one after the last)")
    batches, before, recv_at = posted.batches[r], posted.before[r], posted.recv_at[r]
    made: set[Message] = set()
    for k, entry in enumerate(entries):
        if k > 0:
            sent = produces(acts[k - 1], r, pp, vpp)
            if sent is not None:
                made.add(sent)
        for b in entry:
            if not b:  # nothing to post (StageLink.post posts no empty batch)
                continue
            i = len(batches)
            batches.append(b)
            before.append(k)
            for msg in b.sends:
                if msg not in made:
                    raise PostingError(f"rank {r} sends {describe(msg)} before computing it")
                made.discard(msg)  # each message leaves once
                posted.sends.setdefault((r, owner(msg.dst, pp)[0]), []).append((msg, i))
            for msg in b.recvs:
                if msg in recv_at:
                    raise PostingError(f"rank {r} receives {describe(msg)} twice")
                recv_at[msg] = i
                posted.recvs.setdefault((owner(msg.src, pp)[0], r), []).append((msg, i))
    for k, a in enumerate(acts):
        msg = needs(a, r, pp, vpp)
        if msg is not None and (msg not in recv_at or before[recv_at[msg]] > k):
            raise PostingError(f"rank {r}: {a!r} needs {describe(msg)}, not received before it")


def _pair(posted: _Posted) -> list[list[list[tuple[int, int]]]]:
    """NCCL's rule 2: the i-th send from s to d meets the i-th receive on d from s. Per rank and
    batch, the (peer, peer's batch) pairs it meets; a mismatch or an unmatched message raises."""
    sends, recvs = posted.sends, posted.recvs
    peers: list[list[list[tuple[int, int]]]] = [[[] for _ in bs] for bs in posted.batches]
    for key in sorted(set(sends) | set(recvs)):
        out, into = sends.get(key, []), recvs.get(key, [])
        for (smsg, sb), (rmsg, rb) in zip(out, into):
            if smsg != rmsg:
                raise PostingError(f"rank {key[0]}'s send of {describe(smsg)} meets rank "
                                   f"{key[1]}'s receive of {describe(rmsg)}: NCCL pairs by order")
            peers[key[0]][sb].append((key[1], rb))
            peers[key[1]][rb].append((key[0], sb))
        if len(out) != len(into):
            longer, n = (out, len(into)) if len(out) > len(into) else (into, len(out))
            extra = longer[n][0]
            raise PostingError(f"rank {key[0]} sends {len(out)} messages to rank {key[1]}, which "
                               f"receives {len(into)}: {describe(extra)} is never matched")
    return peers


def _timed(pp, vpp, acts, batches, before, recv_at, peers, t_f, t_b, latency):
    """Times of every batch start, batch completion and compute, in dependency order (Kahn);
    whatever is left unresolved is a hang."""
    # nodes: ("s", r, i) batch start, ("d", r, i) batch done, ("c", r, k) compute end
    deps: dict[tuple, list[tuple]] = {}
    for r in range(pp):
        for i in range(len(batches[r])):
            d = [("d", r, i - 1)] if i else []
            if before[r][i]:
                d.append(("c", r, before[r][i] - 1))
            deps[("s", r, i)] = d
            deps[("d", r, i)] = [("s", r, i)] + [("s", p, j) for p, j in peers[r][i]]
        for k, a in enumerate(acts[r]):
            d = [("c", r, k - 1)] if k else []
            msg = needs(a, r, pp, vpp)
            if msg is not None:
                d.append(("d", r, recv_at[r][msg]))
            deps[("c", r, k)] = d
    users: dict[tuple, list[tuple]] = {}
    waiting = {}
    for node, ds in deps.items():
        waiting[node] = len(ds)
        for d in ds:
            users.setdefault(d, []).append(node)
    time: dict[tuple, float] = {}
    start: dict[tuple[int, int], float] = {}
    ready = deque(n for n, c in waiting.items() if c == 0)
    while ready:
        node = ready.popleft()
        kind, r, i = node
        t = max((time[d] for d in deps[node]), default=0.0)
        if kind == "d":
            mine = time[("s", r, i)]
            for p, j in peers[r][i]:
                t = max(t, max(mine, time[("s", p, j)]) + latency)
        elif kind == "c":
            start[(r, i)] = t
            t += t_f[r] if acts[r][i].forward else t_b[r]
        time[node] = t
        for u in users.get(node, ()):
            waiting[u] -= 1
            if waiting[u] == 0:
                ready.append(u)
    if len(time) < len(deps):
        stuck = []
        for r in range(pp):
            i = next((i for i in range(len(batches[r])) if ("d", r, i) not in time), None)
            if i is None:
                continue
            state = "started" if ("s", r, i) in time else "not started"
            waits = [f"rank {p}'s batch {j}" for p, j in peers[r][i] if ("s", p, j) not in time]
            stuck.append(f"rank {r} batch {i} {_describe_batch(batches[r][i])} ({state}; waits "
                         f"for {', '.join(waits) or 'the batch before it'})")
        raise PostingError("pipeline deadlock under NCCL's ordering: " + "; ".join(stuck))
    return [[(a, start[(r, k)], time[("c", r, k)]) for k, a in enumerate(acts[r])]
            for r in range(pp)]
