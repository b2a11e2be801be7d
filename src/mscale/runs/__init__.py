"""The run directory contract: paths, atomic writes, record readers and writers."""

from mscale.runs.rundir import RunDir

__all__ = ["RunDir"]
