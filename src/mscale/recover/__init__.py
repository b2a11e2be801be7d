"""Recover a failed run: diagnose, choose the checkpoint, keep bad nodes out, relaunch (README.md)."""
