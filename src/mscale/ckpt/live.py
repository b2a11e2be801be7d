"""What a checkpoint reads from, and restores into, one live training process.

The checkpointer, the live `RankLayout` (ownership.py) and the restore (load.py) touch a few
parts of a training process and nothing else; `LiveRank` names them, so a signature says what a
checkpoint depends on and a change to the engine cannot silently reach into it. The engine builds
one (`mscale.train.engine.Engine.live_rank`); `ckpt` never imports `train`.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Protocol

import torch

from mscale.config.plan import Plan
from mscale.distributed.groups import ParallelGroups
from mscale.parallel.buckets import Piece
from mscale.parallel.spec import ParamTable


class OptimizerState(Protocol):
    """The distributed optimizer as a checkpoint sees it (`mscale.parallel.zero.
    DistributedOptimizer`): its flat state over the owned space, which parameter ranges that
    space holds, and the calls that finish or replace it."""

    kind: str
    """``adamw`` or ``lamb`` (recorded, checked on resume)."""
    step_count: int
    master: torch.Tensor
    exp_avg: torch.Tensor
    exp_avg_sq: torch.Tensor
    pieces: list[Piece]
    """The owned space, run by run: the buffer layout's pieces of this rank's shard."""

    def wait_params(self) -> None:
        """Finish the parameter all-gathers a step left in flight."""

    def load_state_dict(self, sd: dict) -> None:
        """Install state keyed by parameter name and local range, then refill the parameters."""


class ClipState(Protocol):
    """The adaptive clipper's history (`mscale.train.clip.AdaptiveClipper`)."""

    def state_dict(self) -> dict: ...

    def load_state_dict(self, sd: dict) -> None: ...


@dataclass(frozen=True)
class LiveRank:
    """One training process, as far as checkpoints are concerned."""

    plan: Plan
    """The plan in force (layout, training settings; recorded in every manifest)."""
    groups: ParallelGroups
    """This rank's coordinates, sizes and process groups."""
    device: torch.device
    """Where the state lives; the writer thread sets it before touching CUDA."""
    params: list[torch.nn.Parameter]
    """The rank's parameters, chunks in order, registration order within (the index space of
    `OptimizerState.pieces`)."""
    table: ParamTable
    """What each of ``params`` is in the global model (name, global shape, TP split)."""
    optimizer: OptimizerState
    clipper: ClipState
    timeout_s: float
    """Timeout of the checkpoint's own collectives (the job's --timeout)."""
