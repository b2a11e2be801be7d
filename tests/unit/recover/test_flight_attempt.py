"""torch's own flight-recorder dump, where train points it (``logs/nccl_trace_attempt<K>_rank_
<N>``: distributed/flight.py `point_torch_dump`), is named as evidence for attempt K only, and,
being a pickle, never unpickled."""

from __future__ import annotations

import pickle

from mscale.recover.diagnose.evidence import collect
from tests.unit.recover.diag_runs import Run


def test_a_dump_named_for_another_attempt_is_not_this_ones(tmp_path):
    """A relaunch within seconds of a timeout: attempt 1's dump is within the file-time slack
    of attempt 2's start, and only its name tells them apart."""
    marker = tmp_path / "pwned"

    class Exploit:
        def __reduce__(self):
            return (open, (str(marker), "w"))

    run = Run(tmp_path / "run")
    run.start(0.0, attempt=1)
    run.start(14.0, attempt=2)
    run.file("logs/nccl_trace_attempt1_rank_3", pickle.dumps(Exploit()), t=15)
    run.file("logs/nccl_trace_attempt2_rank_0", pickle.dumps(Exploit()), t=30)
    ev = collect(run.path)
    assert [(f.source, r, doc) for f, r, doc in ev.flight] == [
        ("logs/nccl_trace_attempt2_rank_0", 0, None)]
    assert not marker.exists()
