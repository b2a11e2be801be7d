"""Stage 1 of a save on its writer thread: the thread makes the rank's device current before it
copies (a new host thread starts on GPU 0). The copy itself on a GPU is bench/gpu_ckpt_check.py."""

from __future__ import annotations

import threading

import torch

from mscale.ckpt.ownership import Item
from mscale.ckpt.snapshot import CopyGate, HostArena
from mscale.ckpt.writer import BackgroundWriter, snapshot_and_write


def _items(tensors: list[torch.Tensor]) -> list[Item]:
    return [Item(f"optim.master/t{i}", (t.numel(),), "float32", ((0, t.numel()),),
                 (0, t.numel()), ("param", i)) for i, t in enumerate(tensors)]


def test_writer_thread_sets_the_device_save_captured(tmp_path, monkeypatch):
    calls = []
    monkeypatch.setattr(torch.cuda, "set_device",
                        lambda d: calls.append((torch.device(d), threading.get_ident())))
    tensors = [torch.arange(5, dtype=torch.float32), torch.ones(70, dtype=torch.float32)]
    writer, arena, gate = BackgroundWriter(), HostArena(), CopyGate()
    try:
        future = writer.submit(snapshot_and_write, arena, gate, _items(tensors), tensors, None,
                               str(tmp_path / "step-000001"), 3, "raw", 0, 1 << 20,
                               device=torch.device("cuda", 3))
        result, _ = future.result(timeout=60)
        worker = writer.submit(threading.get_ident).result(timeout=60)
    finally:
        writer.close()
    assert calls == [(torch.device("cuda", 3), worker)] and worker != threading.get_ident()
    assert result.raw_bytes == 4 * 75

