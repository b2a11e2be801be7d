"""The training loop and what surrounds it: data, timers, metrics, control, launch."""
