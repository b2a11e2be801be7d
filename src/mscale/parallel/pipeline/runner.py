"""Execute this rank's pipeline schedule for one training step.

The schedule (schedule.py) fixes the order of forwards and backwards; this module runs it:
inputs come from the data loader (first virtual stage: tokens; last: labels) or from the
previous stage (`StageLink`), outputs go to the next.

What is posted to the PP group, and when, is `posting.posting_plan`: before the first action and
right after each action's compute, the plan's ``batch_isend_irecv`` batches, in order, and nothing
else (`p2p.PlanWalker` walks the plan, here and in the eval pass). That order is what NCCL needs
(docs/pipeline.md, "Transfers and overlap"): every batch on the PP communicator runs on one NCCL
stream in issue order and completes only when all its operations have met their peers', so a
receive posted early blocks every later batch of the rank, the sends included. 1F1B sends each
output together with the receive of the next action (Megatron-LM's ``send_forward_recv_backward`` /
``send_backward_recv_forward``); interleaved 1F1B pairs by direction, an activation's send with the
receive of the next forward, a gradient's send with the receive of the next backward, so each
transfer overlaps the compute of the action between (Megatron-LM's ``overlap_p2p_comm``).
`posting.replay_nccl` replays the same plan of every rank under NCCL's rules and proves it cannot
hang (tests/unit/parallel/test_pipeline_posting.py; test_pipeline_events.py checks that this
module posts and waits exactly where the plan says); gloo, which completes each operation on its
own, runs it too.

Data parallelism: every backward runs inside ``grads.no_sync()`` except the backward of the
last micro-batch on each chunk (a chunk sees its micro-batches in order, so that is its final
gradient). There the gradient buffer starts each bucket's DP reduction as soon as it is full,
overlapping the rest of the cool-down. The buffer orders buckets by reverse registration, i.e.
last chunk first, which is also the order in which chunks finish under interleaving.

Timing, per rank: a wait for a receive is ``bubble`` while the pipeline fills (up to and
including this rank's first backward) or drains (after its last forward): nothing else could run
then. A wait in the steady state, posting a batch, or waiting for sends at the end of the step
is ``comm_wait``: a slow link or a slow neighbour. Under NCCL a wait also covers the sends
batched with the receive (one coalesced work per batch). Compute is the rest (StepTimer).
"""

from __future__ import annotations

import contextlib
from dataclasses import dataclass
from typing import TYPE_CHECKING, Callable

import torch

from mscale.errors import MscaleError
from mscale.parallel.pipeline.p2p import PlanWalker, StageLink, boundary_shape
from mscale.parallel.pipeline.posting import posting_plan
from mscale.parallel.precision import Precision
from mscale.distributed.init import to_device
from mscale.parallel.pipeline.schedule import (Action, Message, check_micro_batches, needs,
                                               phases, produces, schedule, virtual_stage)

if TYPE_CHECKING:  # the buffer is built by the engine; the runner only enters its no_sync
    from mscale.parallel.data import GradBuffer


@dataclass(frozen=True)
class PipelineStage:
    """What the runner needs of one rank, typed and built once (`build_stage`), instead of the
    whole training engine: its chunks and place in the pipeline, its link to the neighbours, its
    batch reader, the DP gradient buffer and the precision contexts."""

    chunks: list[torch.nn.Module]
    """This rank's model chunks, one per virtual stage, in chunk order."""
    pp: int
    vpp: int
    pp_rank: int
    micro_batches: int
    """Micro-batches per step per replica."""
    device: torch.device
    link: StageLink
    """Activation/gradient transfer with the neighbouring stages."""
    get_batch: Callable[[int, int], tuple[torch.Tensor, torch.Tensor]]
    """(step, micro) → (tokens, labels) on the host."""
    grads: GradBuffer
    """The DP gradient buffer: every backward but a chunk's last runs in its ``no_sync()``."""
    precision: Precision
    """Autocast around each chunk forward; the step-long ``cast_scope`` around the whole step
    (`run_pipeline_step`), so every micro-batch shares one bf16 copy of each weight."""


def build_stage(plan, groups, chunks: list[torch.nn.Module], *, device: torch.device,
                get_batch: Callable[[int, int], tuple[torch.Tensor, torch.Tensor]],
                grads: GradBuffer, precision: Precision) -> PipelineStage:
    """The rank's PipelineStage. Collective over the PP group: the link's first use is an
    all-reduce of one element on the device, since NCCL wants every member in a group's first
    call before subsets talk point-to-point. Not a barrier: on a group of both backends
    (``cpu:gloo,cuda:nccl``) torch runs a barrier on gloo, which leaves NCCL untouched."""
    layout = plan.layout
    shape = boundary_shape(plan, groups.tp_size, layout.sequence_parallel)
    torch.distributed.all_reduce(torch.zeros(1, device=device), group=groups.pp_group)
    link = StageLink(groups.pp_group, groups.pp_ranks, layout.vpp, shape, device)
    return PipelineStage(chunks=chunks, pp=layout.pp, vpp=layout.vpp, pp_rank=groups.pp_rank,
                         micro_batches=layout.micro_batches(plan.training.global_batch),
                         device=device, link=link, get_batch=get_batch, grads=grads,
                         precision=precision)


class PipelineStep:
    """State of one step on one rank: what is in flight and what awaits its backward."""

    def __init__(self, stage: PipelineStage, step: int, timer):
        self.stage, self.step, self.timer = stage, step, timer
        self.pp, self.vpp, self.m, self.rank = stage.pp, stage.vpp, stage.micro_batches, stage.pp_rank
        reason = check_micro_batches(self.pp, self.vpp, self.m)
        if reason:
            raise MscaleError(reason, field="layout.micro_batch",
                              fix="raise global_batch or lower micro_batch (see mscale plan)")
        self.last_stage = self.pp * self.vpp - 1
        self.actions = schedule(self.pp, self.vpp, self.m, self.rank)
        self.posting = PlanWalker(stage.link, posting_plan(self.pp, self.vpp, self.m, self.rank))
        """Posts ``plan[0]`` before action 0 and ``plan[k + 1]`` after action k."""
        self.first_b, self.last_f = phases(self.actions)
        self.saved: dict[tuple[int, int], tuple[torch.Tensor | None, torch.Tensor]] = {}
        """(micro, chunk) → (input that needs its gradient, output to run backward from)."""
        self.loss_sum: torch.Tensor | None = None
        """Sum of this rank's micro-batch losses, kept on the device (float64, in order)."""

    def _need(self, k: int):
        return needs(self.actions[k], self.rank, self.pp, self.vpp) if k < len(self.actions) else None

    def run(self) -> torch.Tensor | None:
        self._post()
        for k, action in enumerate(self.actions):
            with self.timer.work("forward" if action.forward else "backward", action.micro,
                                 action.chunk):
                out = self._forward(k, action) if action.forward else self._backward(k, action)
            self._post(produces(action, self.rank, self.pp, self.vpp), out)
        with self.timer.region("comm_wait", link="pp"):
            self.posting.finish()
        return None if self.loss_sum is None else self.loss_sum / self.m

    def _post(self, sent: Message | None = None, out: torch.Tensor | None = None) -> None:
        """Post the plan's next entry (with ``sent``, the output just computed). Posting is
        pipeline communication: gloo writes a small send inline, so a slow link shows here (as
        pp wait), not as compute of this rank."""
        with self.timer.region("comm_wait", link="pp"):
            self.posting.post_next(sent, out)

    def _receive(self, k: int) -> torch.Tensor:
        """Wait for action k's input; the wait counts as bubble in warm-up and cool-down."""
        region = "bubble" if k <= self.first_b or k > self.last_f else "comm_wait"
        with self.timer.region(region, link="pp"):
            return self.posting.wait(self._need(k))

    def _batch(self, micro: int) -> tuple[torch.Tensor, torch.Tensor]:
        with self.timer.region("data"):
            tokens, labels = self.stage.get_batch(self.step, micro)
            device = self.stage.device  # pinned and asynchronous to a GPU
            return to_device(tokens, device), to_device(labels, device)

    def _forward(self, k: int, a: Action) -> torch.Tensor:
        """Run one chunk forward; return what goes to the next stage (the loss on the last)."""
        stage, vs = self.stage, virtual_stage(self.rank, a.chunk, self.pp)
        if vs == 0:
            x, _ = self._batch(a.micro)
            grad_in = None
        else:
            x = grad_in = self._receive(k).requires_grad_()
        chunk = stage.chunks[a.chunk]
        if vs == self.last_stage:
            _, labels = self._batch(a.micro)
            with stage.precision.autocast():
                loss = chunk(x, labels)
            value = loss.detach().double()  # no host sync: read once per step, in the gather
            self.loss_sum = value if self.loss_sum is None else self.loss_sum + value
            self.saved[(a.micro, a.chunk)] = (grad_in, loss / self.m)
            return loss
        with stage.precision.autocast():
            out = chunk(x)
        self.saved[(a.micro, a.chunk)] = (grad_in, out)
        return out

    def _backward(self, k: int, a: Action) -> torch.Tensor | None:
        """Backward of one chunk; return the gradient of its input (None on the first stage)."""
        x, out = self.saved.pop((a.micro, a.chunk))
        grad = None if self._need(k) is None else self._receive(k)
        last = a.micro == self.m - 1  # this chunk's final gradient: let DP reduction start
        with contextlib.nullcontext() if last else self.stage.grads.no_sync():
            torch.autograd.backward(out, grad_tensors=grad)
        return None if x is None else x.grad


def run_pipeline_step(stage: PipelineStage, step: int, timer) -> torch.Tensor | None:
    """One step's forwards and backwards under 1F1B / interleaved 1F1B.

    Returns this rank's mean loss over the step's micro-batches on the rank holding the last
    virtual stage (a 0-dim float64 tensor on the device, as `train.step.run_micro_batches`),
    None elsewhere. Gradients end in the DP gradient buffer with the reduction of every bucket
    launched (the loop's ``grads.finish()`` waits for it). All of it runs inside the stage's
    ``cast_scope``: the bf16 weight copies are made once and shared by every micro-batch and
    chunk in flight, and dropped on return, before the optimizer updates the weights.
    """
    with stage.precision.cast_scope():
        return PipelineStep(stage, step, timer).run()
