"""mscale.data.encode: the main thread never encodes, so it reports while a large document is
being tokenized and an interruption stops the worker processes at once instead of waiting for
their batches."""

from __future__ import annotations

import threading
import time
from dataclasses import dataclass

import pytest

from mscale.data import encode
from mscale.data.encode import Encoder, terminate_workers
from mscale.data.prepare import prepare

from tests.unit.data.corpus_text import decoded, text


@dataclass
class Batch:
    texts: list
    nbytes: int


def test_progress_goes_on_while_one_large_document_is_tokenized(tokenizer, tmp_path,
                                                                monkeypatch):
    """One .txt file is one batch: its encoding is held until the main thread has reported it
    in flight (it encoded inline with one worker, and reported only per finished batch)."""
    monkeypatch.setattr(encode, "WAIT_S", 0.01)
    reported = threading.Event()
    real = encode._Codec.encode

    def held(self, texts):
        assert reported.wait(60), "the main thread never reported the batch in flight"
        return real(self, texts)

    monkeypatch.setattr(encode._Codec, "encode", held)
    big = tmp_path / "big.txt"
    big.write_text(text(7, 200))
    seen = []

    def progress(*a):
        seen.append(a)
        if a[3]:
            reported.set()

    m = prepare([str(big)], tokenizer, str(tmp_path / "out"), workers=1, progress=progress)
    size = big.stat().st_size
    assert seen[0] == (0, 0, 0, size)  # nothing written yet, the whole file being tokenized
    assert seen[-1] == (1, m["tokens"], size, 0)
    assert decoded(tmp_path / "out", tokenizer) == [text(7, 200)]


def test_one_worker_encodes_on_a_daemon_thread(tokenizer, monkeypatch):
    """So that Ctrl-C reaches the main thread at once and the process need not wait for it."""
    where = []
    real = encode._Codec.encode

    def spy(self, texts):
        where.append(threading.current_thread())
        return real(self, texts)

    monkeypatch.setattr(encode._Codec, "encode", spy)
    tok_json = open(tokenizer, encoding="utf-8").read()
    enc = Encoder(1, tok_json, 0, "uint16")
    got = list(enc.map([Batch(["the model"], 9), Batch(["a rank"], 6)]))
    enc.close()
    assert [b.nbytes for b, _, _ in got] == [9, 6] and all(f[-1] == 0 for _, f, _ in got)
    assert len(where) == 2 and where[0] is not threading.main_thread() and where[0].daemon


def test_an_interruption_terminates_busy_worker_processes_at_once(tokenizer):
    """Ctrl-C while the workers encode: they are terminated, not waited for (the pool's
    shutdown(wait=True) waited for every batch in flight, 29 s for a 28 MB file)."""
    tok_json = open(tokenizer, encoding="utf-8").read()
    enc = Encoder(2, tok_json, 0, "uint16", wait_s=0.05)
    enc._submit = lambda texts: enc._pool.submit(time.sleep, 120)  # a batch that takes minutes
    waits = []

    def on_wait():
        waits.append(enc.pending_bytes)
        if len(waits) == 3:
            raise KeyboardInterrupt

    with pytest.raises(KeyboardInterrupt):
        for _ in enc.map([Batch(["x"], 10), Batch(["y"], 20)], on_wait=on_wait):
            pass
    processes = list(enc._pool._processes.values())
    assert processes
    # timed from the abort, not from the pool's start: starting two workers took over 30 s
    # under a loaded CI run, and failed a test of how fast they are ended
    t0 = time.monotonic()
    enc.abort()
    assert waits == [30, 30, 30]  # both batches in flight, reported while waiting
    assert all_dead(processes, t0)


def all_dead(processes, t0: float, within_s: float = 30.0) -> bool:
    """Every process ended within ``within_s`` of ``t0``, not after its 120 s batch: gone, or a
    zombie its parent has not reaped yet. Judged from /proc, not `Process.is_alive`: a forkserver
    worker's end reaches its parent only once the fork server reaps it and writes the status, a
    step that took over 30 s in a loaded run (load 10 on two cores) after the worker had died."""
    pids = [p.pid for p in processes]
    while any(_running(pid) for pid in pids) and time.monotonic() - t0 < within_s:
        time.sleep(0.05)
    return not any(_running(pid) for pid in pids) and time.monotonic() - t0 < within_s


def _running(pid: int) -> bool:
    try:
        with open(f"/proc/{pid}/stat") as f:
            return f.read().rsplit(")", 1)[1].split()[0] != "Z"
    except FileNotFoundError:
        return False


def test_terminate_workers_cancels_the_queue_and_stops_the_processes():
    import multiprocessing as mp
    from concurrent.futures import ProcessPoolExecutor

    pool = ProcessPoolExecutor(1, mp_context=mp.get_context("spawn"))
    running = pool.submit(time.sleep, 120)
    queued = [pool.submit(time.sleep, 120) for _ in range(3)]
    while not running.running():
        time.sleep(0.01)
    processes = list(pool._processes.values())
    t0 = time.monotonic()
    terminate_workers(pool)
    assert all_dead(processes, t0)
    # the queued work ends too (cancelled, or failed with the pool: the manager thread decides)
    while not queued[-1].done() and time.monotonic() - t0 < 30:
        time.sleep(0.05)
    assert queued[-1].cancelled() or queued[-1].exception(timeout=0) is not None
