"""The LLaMA/GPT-class decoder and its parameters by global name."""

from mscale.model.chunks import build_chunks
from mscale.model.params import full_state_dict, init_parameters
from mscale.model.transformer import Transformer

__all__ = ["Transformer", "build_chunks", "init_parameters", "full_state_dict"]
