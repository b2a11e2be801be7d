"""Checkpoints: sharded two-stage async save, commit protocol, resharding load, convert, verify.

See README.md beside this file and docs/ckpt.md. Low-level modules (slices, manifest, format,
catalog, safetensors, verify) import nothing from model/parallel; the engine-facing ones
(ownership, snapshot, checkpointer, load, convert, hf) sit between train and model/parallel.
"""
