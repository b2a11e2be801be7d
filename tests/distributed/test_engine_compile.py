"""`training.compile: true` in the real engine: the blocks' regions are compiled before ZeRO's
parameter all-gather hooks go on, so no hook sits on (and would be traced into) a compiled
region. Compilation is lazy, so nothing here runs inductor; tests/unit/parallel/test_compile.py
and the compiled cases of test_tensor_parallel.py check what the compiled regions compute."""

import pytest

from tests.distributed.engine_cases import build_case_engine
from tests.distributed.harness import run_distributed

pytestmark = pytest.mark.dist


def _built(rank, world, case):
    from mscale.parallel.compile import is_compiled

    engine = build_case_engine(rank, world, case)
    try:
        blocks = [b for c in engine.chunks for b in c.layers.values()]
        regions = [getattr(b, n) for b in blocks for n in ("attn", "mlp", "attn_norm", "mlp_norm")]
        hooked = {id(m) for c in engine.chunks for m in c.modules() if m._forward_pre_hooks}
        return dict(flag=engine.compiled, compiled=sum(is_compiled(r) for r in regions),
                    regions=len(regions),
                    hooked_compiled=sum(id(m) in hooked for r in regions for m in r.modules()),
                    hooked_blocks=sum(id(b) in hooked for b in blocks), blocks=len(blocks))
    finally:
        engine.grads.close()
        engine.loader.close()


def test_compiled_regions_carry_no_zero_hook():
    case = dict(dp=2, zero=1, training=dict(compile=True))  # ZeRO-1 at DP 2: deferred gathers
    for got in run_distributed(_built, 2, case):
        assert got["flag"] and got["compiled"] == got["regions"] == 4 * got["blocks"], got
        assert got["hooked_compiled"] == 0 and got["hooked_blocks"] == got["blocks"], got
