"""Checks of the training data that the launcher makes before any worker starts.

Kept apart from `train.data` so that the ``--local`` launcher, which only checks and starts
processes, never imports torch: importing it costs ~3 s of CPU, paid once by every worker and,
before this split, once more by the launcher before the first worker started.
"""

from __future__ import annotations

import os
import stat

import numpy as np

from mscale.errors import MscaleError


def check_token_file(path: str, dtype: str) -> None:
    """Refuse, before any worker starts, a token file that is missing, not a regular file, or whose
    size is not a whole number of tokens (a wrong ``data.dtype``, or a file cut short)."""
    field = "training.data.path"
    try:
        st = os.stat(path)
    except FileNotFoundError:
        raise MscaleError("token file not found", file=path, field=field,
                          fix="point data.path at a flat uint16/uint32 token file") from None
    except OSError as e:
        raise MscaleError(f"cannot read the token file: {e.strerror}", file=path, field=field,
                          fix="check the path and its permissions") from None
    if not stat.S_ISREG(st.st_mode):
        raise MscaleError("token file is not a regular file", file=path, field=field,
                          fix="point data.path at a flat uint16/uint32 token file")
    width = np.dtype(dtype).itemsize
    if st.st_size % width:
        raise MscaleError(f"size {st.st_size} B is not a multiple of the token width {width} B "
                          f"({dtype})", file=path, field="training.data.dtype",
                          fix="check data.dtype (uint16 vs uint32), or whether the file was cut "
                              "short while being written")
