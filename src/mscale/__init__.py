"""mscale: plan, check, train, watch, checkpoint and recover LLM training at scale."""

__version__ = "0.1.0"
