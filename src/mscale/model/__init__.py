"""The LLaMA/GPT-class decoder in plain PyTorch, and its initial values by global name."""

from mscale.model.params import init_weights
from mscale.model.transformer import Transformer

__all__ = ["Transformer", "init_weights"]
