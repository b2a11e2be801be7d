"""Tensor-parallel building blocks at tp=1: no collectives, same maths as plain PyTorch."""

import torch
import torch.nn.functional as F

from mscale.parallel import tensor_ops
from mscale.parallel.tensor import TensorParallel, vocab_parallel_cross_entropy

SINGLE = TensorParallel.single()


def test_vocab_parallel_cross_entropy_matches_torch_and_its_gradient():
    gen = torch.Generator().manual_seed(0)
    logits = (torch.randn(5, 7, 33, generator=gen) * 30).requires_grad_()  # large: needs the max
    labels = torch.randint(0, 33, (5, 7), generator=gen)
    ours = vocab_parallel_cross_entropy(logits, labels, SINGLE)
    (grad,) = torch.autograd.grad(ours, logits)
    ref_logits = logits.detach().clone().requires_grad_()
    ref = F.cross_entropy(ref_logits.reshape(-1, 33), labels.reshape(-1))
    ref.backward()
    torch.testing.assert_close(ours, ref)
    torch.testing.assert_close(grad, ref_logits.grad)


def test_size_one_group_skips_every_collective():
    x = torch.randn(4, 2, 3)
    for fn in (tensor_ops.copy_to_tp, tensor_ops.reduce_from_tp, tensor_ops.scatter_to_sp,
               tensor_ops.gather_from_sp, tensor_ops.reduce_scatter_to_sp):
        assert fn(x, SINGLE) is x  # no process group exists: any collective would raise
    assert SINGLE.enter(x) is x and SINGLE.exit(x) is x
    assert not TensorParallel(None, 1, 0, sequence_parallel=True).sp
