"""Pydantic schemas for every file mscale reads or writes (configs, plans, run-directory records)."""

from mscale.config.base import load_model
from mscale.config.cluster import ClusterConfig
from mscale.config.gpus import GPU_PRESETS, GPUSpec
from mscale.config.layout import LayoutConfig, check_layout
from mscale.config.model import ModelConfig
from mscale.config.plan import Plan, load_plan
from mscale.config.training import DataConfig, TrainingConfig

__all__ = [
    "GPU_PRESETS", "ClusterConfig", "DataConfig", "GPUSpec", "LayoutConfig", "ModelConfig", "Plan",
    "TrainingConfig", "check_layout", "load_model", "load_plan",
]
