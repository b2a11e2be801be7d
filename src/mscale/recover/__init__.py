"""Recover a failed run: diagnose, choose the checkpoint, keep bad nodes out, relaunch.

README.md has the stages and the rules that hold across them."""
