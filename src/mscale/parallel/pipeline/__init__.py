"""Pipeline parallelism: 1F1B and interleaved 1F1B over the PP group (docs/pipeline.md).

- `schedule`: the actions of every rank as pure data, with a simulator that proves the
  schedules deadlock-free and reproduces the bubble formulas.
- `stages`: which blocks, embedding and head each rank's chunks hold (`rank_chunks`, as data;
  `parallel.parallelize.build_chunks` builds the modules).
- `posting`: what each rank posts to the PP group and when, as data, with a replay of all ranks'
  batches under NCCL's rules (one stream per communicator, order matching) that proves the
  order cannot hang.
- `p2p`: activation and gradient transfer between neighbouring stages, and `PlanWalker`, which
  posts a rank's plan on it (for the runner and the eval pass).
- `runner`: executes a rank's schedule for one training step, posting its plan.

The runner is imported on first use: `schedule` and `posting` are pure Python, and watch
replays the schedule (watch/replay.py) without loading torch.
"""

__all__ = ["ChunkSpec", "rank_chunks", "run_pipeline_step"]


def __getattr__(name: str):
    if name == "run_pipeline_step":
        from mscale.parallel.pipeline.runner import run_pipeline_step
        return run_pipeline_step
    if name in ("ChunkSpec", "rank_chunks"):
        from mscale.parallel.pipeline import stages
        return getattr(stages, name)
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
