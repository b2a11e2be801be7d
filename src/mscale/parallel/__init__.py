"""Tensor + sequence parallel layers, pipeline schedules, data parallel with ZeRO."""
