"""The checkpoint's shard layout from the plan alone equals the live engine's, at several layouts.

Offline conversion (`mscale ckpt convert`) writes, for every rank of a target plan, the slices
`ownership.for_plan` derives without any process; a resumed job then reads them with the layout
of its live engine. If the two disagreed (bucket size, the hierarchical ZeRO shard order, the
parameter order under interleaving), a converted checkpoint would load into the wrong shards
without any error. Each case below builds the real engine on 8 gloo processes.
"""

from __future__ import annotations

import pytest

from tests.distributed.ckpt_cases import layouts_agree
from tests.distributed.harness import run_distributed

pytestmark = pytest.mark.dist

CASES = [
    dict(tp=2, pp=2, dp=2, zero=1, sp=True),
    # 4 nodes of 2: DP rank 2j+i owns shard 4i+j, not its DP rank
    dict(tp=1, pp=1, dp=8, zero=1, hier=True, mb=1),
    dict(tp=2, pp=1, dp=4, zero=2, hier=True, gpn=4),
    dict(tp=1, pp=2, dp=4, zero=0, hier=True, gpn=4, mb=1),
    # interleaved stages, and a bucket size that is not a whole number of elements
    dict(tp=1, pp=2, dp=4, vpp=2, zero=1, mb=1, model=dict(layers=4),
         training=dict(bucket_mb=0.0123457)),
    # chunks without blocks: rank 0's first holds only the embedding, rank 1's last the head
    dict(tp=1, pp=2, dp=4, vpp=2, zero=2, mb=1, model=dict(layers=4), stage_layers=[0, 2, 2, 0]),
]


def test_plan_layout_equals_live_engine_layout():
    per_rank = run_distributed(layouts_agree, 8, CASES, timeout_s=120)
    problems = [d for r in per_rank for d in r if d is not None]
    assert problems == [], "\n".join(problems[:4])
