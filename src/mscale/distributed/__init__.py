"""Process groups from a plan (nccl on GPUs, gloo on CPUs), collective helpers, clean shutdown."""
