"""Environment variables known to hurt, judged per node."""

import pytest

from mscale.preflight.environment import environment_checks


def _status(env, gpu=True, **kw):
    return {r.entity: r.status for r in environment_checks("n1", env, gpu=gpu, **kw)}


def test_clean_environment_is_one_ok():
    assert _status({"NCCL_DEBUG": "INFO", "PATH": "/bin"}) == {"n1": "OK"}


@pytest.mark.parametrize("var,value,status", [
    ("NCCL_IB_DISABLE", "1", "CRITICAL"), ("NCCL_P2P_DISABLE", "1", "CRITICAL"),
    ("NCCL_NET_GDR_LEVEL", "LOC", "WARNING"), ("NCCL_PROTO", "Simple", "WARNING"),
    ("NCCL_MAX_NCHANNELS", "1", "WARNING"), ("NCCL_DEBUG", "trace", "WARNING"),
    ("CUDA_LAUNCH_BLOCKING", "1", "WARNING"), ("TORCH_NCCL_ASYNC_ERROR_HANDLING", "0", "WARNING"),
])
def test_each_hurting_variable_is_named_with_why(var, value, status):
    (r,) = environment_checks("n1", {var: value}, gpu=True)
    assert (r.entity, r.status, r.node) == (f"n1:{var}", status, "n1")
    assert f"{var}={value}" in r.message and "unset" in r.message


@pytest.mark.parametrize("var,value", [("NCCL_IB_DISABLE", "0"), ("NCCL_MAX_NCHANNELS", "16"),
                                       ("NCCL_NET_GDR_LEVEL", "PHB")])
def test_harmless_values_pass(var, value):
    assert _status({var: value}) == {"n1": "OK"}


def test_gpu_rules_do_not_apply_to_gloo_runs():
    env = {"NCCL_IB_DISABLE": "1", "TORCH_DISTRIBUTED_DEBUG": "DETAIL"}
    assert _status(env, gpu=False) == {"n1:TORCH_DISTRIBUTED_DEBUG": "WARNING"}


def test_nccl_ib_hca_checked_against_the_nodes_devices():
    devs = ["mlx5_0", "mlx5_1"]
    assert _status({"NCCL_IB_HCA": "mlx5"}, ib_devices=devs) == {"n1": "OK"}
    assert _status({"NCCL_IB_HCA": "=mlx5_0:1,mlx5_1:1"}, ib_devices=devs) == {"n1": "OK"}
    assert _status({"NCCL_IB_HCA": "mlx5_0,mlx5_7"}, ib_devices=devs) == {
        "n1:NCCL_IB_HCA": "WARNING"}
    assert _status({"NCCL_IB_HCA": "=mlx5"}, ib_devices=devs) == {"n1:NCCL_IB_HCA": "CRITICAL"}
    assert _status({"NCCL_IB_HCA": "^mlx5_9"}, ib_devices=devs) == {"n1": "OK"}

