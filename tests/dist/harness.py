"""The distributed tests' entry to `mscale.dist.spawn` (run a function on N gloo processes)."""

from mscale.dist.spawn import DistributedRunError, free_port, run_distributed

__all__ = ["DistributedRunError", "free_port", "run_distributed"]
