"""The distributed tests' entry to `mscale.distributed.spawn` (run a function on N gloo processes)."""

from mscale.distributed.spawn import DistributedRunError, free_port, run_distributed

__all__ = ["DistributedRunError", "free_port", "run_distributed"]
