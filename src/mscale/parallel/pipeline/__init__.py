"""Pipeline parallelism: 1F1B and interleaved 1F1B over the PP group (docs/pipeline.md).

- `schedule`: the actions of every rank as pure data, with a simulator that proves the
  schedules deadlock-free and reproduces the bubble formulas.
- `stages`: which blocks, embedding and head each rank's chunks hold (`rank_chunks`, as data;
  `mscale.model.build_chunks` builds the modules).
- `p2p`: activation and gradient transfer between neighbouring stages.
- `runner`: executes a rank's schedule for one training step.
"""

from mscale.parallel.pipeline.runner import run_pipeline_step
from mscale.parallel.pipeline.stages import ChunkSpec, rank_chunks

__all__ = ["ChunkSpec", "rank_chunks", "run_pipeline_step"]


def __getattr__(name: str):
    """Transition only: `ckpt/ownership.py` still imports ``build_stage_chunks`` from here.
    Remove with its entry in tests/unit/test_layering.py once it calls `mscale.model.build_chunks`."""
    if name == "build_stage_chunks":
        from mscale.model.chunks import build_chunks

        return lambda plan, groups, tp, device: build_chunks(plan, groups.pp_rank, tp, device)
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
