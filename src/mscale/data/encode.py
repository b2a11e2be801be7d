"""Where `mscale data prepare` tokenizes: batches of documents encoded off the main thread, the
results handed back in submission order.

``workers`` > 1: that many processes (forkserver or spawn: never a fork of a process whose
tokenizer threads may run; a worker exits if the main process dies; Ctrl-C is the main
process's). Each builds the tokenizer once from the JSON text the main process hashed. One
worker: one daemon thread of this process (``encode_batch`` releases the GIL, measured). Either
way the main thread never encodes, so it can wait with a timeout: it reports what is in flight
while one large document is being tokenized (a 300 MB .txt file is one batch of minutes), and
Ctrl-C reaches it at once. On an interruption or error the worker processes are terminated
rather than waited for; a daemon thread is left to die with the process.

The output does not depend on the worker count: results come back in submission order, and at
most ``2 × workers`` batches (one, with one worker) are in flight.
"""

from __future__ import annotations

import os
import queue
import signal
import threading
import time
from collections import deque
from concurrent.futures import Future, ProcessPoolExecutor, wait
from concurrent.futures.process import BrokenProcessPool
from typing import Callable, Iterable, Iterator, Protocol

import numpy as np

from mscale.errors import MscaleError

WAIT_S = 1.0
"""How often the main thread, waiting for a batch, calls ``on_wait`` (progress while a large
document is being tokenized)."""
TERMINATE_WAIT_S = 5.0
"""How long a terminated worker process is waited for before the interruption goes on."""


class Batch(Protocol):
    """What `Encoder.map` needs of a batch: its texts and the input bytes they came from."""

    texts: list[str]
    nbytes: int


class _Codec:
    """One tokenizer and what every document gets: no special tokens besides the end-of-document
    id appended (no BOS: documents are separated by EOD alone)."""

    def __init__(self, tok_json: str, eod: int, dtype: str) -> None:
        from tokenizers import Tokenizer

        self.tok, self.eod, self.dtype = Tokenizer.from_str(tok_json), eod, np.dtype(dtype)

    def encode(self, texts: list[str]) -> tuple[np.ndarray, np.ndarray]:
        """Token ids of every document, EOD appended, back to back; and their lengths."""
        flat: list[int] = []
        lengths = np.empty(len(texts), dtype=np.int64)
        for i, enc in enumerate(self.tok.encode_batch(texts, add_special_tokens=False)):
            ids = enc.ids
            flat += ids
            flat.append(self.eod)
            lengths[i] = len(ids) + 1
        return np.array(flat, dtype=self.dtype), lengths


_CODEC: list[_Codec] = []
"""A worker process's codec (one), built by `_init_worker`."""


def _init_worker(tok_json: str, eod: int, dtype: str, main_pid: int) -> None:
    """In each worker process: one tokenizer, its own thread pool off (the processes are the
    pool); Ctrl-C ignored (the main process stops the pool and removes the temporary folder)."""
    os.environ["TOKENIZERS_PARALLELISM"] = "false"
    signal.signal(signal.SIGINT, signal.SIG_IGN)
    threading.Thread(target=_exit_with, args=(main_pid,), daemon=True).start()
    _CODEC[:] = [_Codec(tok_json, eod, dtype)]


def _exit_with(pid: int, every_s: float = 1.0) -> None:
    """A worker whose main process died (kill -9) exits too, rather than wait forever for work."""
    while True:
        time.sleep(every_s)
        try:
            os.kill(pid, 0)
        except ProcessLookupError:
            os._exit(1)
        except PermissionError:  # the pid was reused by another user's process
            os._exit(1)


def _encode(texts: list[str]) -> tuple[np.ndarray, np.ndarray]:
    return _CODEC[0].encode(texts)


class _DaemonThread:
    """One daemon thread running submitted calls in order. Not a ThreadPoolExecutor: its threads
    are joined at interpreter exit, so Ctrl-C during a long encode would still wait for it."""

    def __init__(self) -> None:
        self._jobs: queue.SimpleQueue = queue.SimpleQueue()
        threading.Thread(target=self._run, name="mscale-encode", daemon=True).start()

    def submit(self, fn: Callable, *args) -> Future:
        fut: Future = Future()
        self._jobs.put((fut, fn, args))
        return fut

    def _run(self) -> None:
        while (job := self._jobs.get()) is not None:
            fut, fn, args = job
            if not fut.set_running_or_notify_cancel():
                continue
            try:
                fut.set_result(fn(*args))
            except BaseException as e:  # noqa: BLE001 - handed to the waiting main thread
                fut.set_exception(e)

    def stop(self) -> None:
        """Ends the thread once the call it runs (if any) returns; does not wait for it."""
        self._jobs.put(None)


class Encoder:
    """Encodes batches on ``workers`` processes (or one daemon thread), results in submission
    order, at most ``2 × workers`` batches in flight (one with one worker): the reader never runs
    ahead of the writer by more. `close` after success, `abort` on any exception."""

    def __init__(self, workers: int, tok_json: str, eod: int, dtype: str,
                 wait_s: float | None = None) -> None:
        import multiprocessing as mp

        self.wait_s = WAIT_S if wait_s is None else wait_s
        self.depth = 2 * workers if workers > 1 else 1
        self._window: deque = deque()
        self._pool: ProcessPoolExecutor | None = None
        self._thread: _DaemonThread | None = None
        self._saved_env: str | None = None
        if workers > 1:
            methods = mp.get_all_start_methods()
            ctx = mp.get_context("forkserver" if "forkserver" in methods else "spawn")
            self._pool = ProcessPoolExecutor(workers, mp_context=ctx, initializer=_init_worker,
                                             initargs=(tok_json, eod, dtype, os.getpid()))
        else:  # this process, its tokenizer threads off: one worker means one CPU
            self._saved_env = os.environ.get("TOKENIZERS_PARALLELISM")
            os.environ["TOKENIZERS_PARALLELISM"] = "false"
            self._codec = _Codec(tok_json, eod, dtype)
            self._thread = _DaemonThread()

    @property
    def pending_bytes(self) -> int:
        """Input bytes of the batches sent and not yet handed back: what is being tokenized."""
        return sum(b.nbytes for b, _ in self._window)

    def _submit(self, texts: list[str]) -> Future:
        if self._pool is not None:
            return self._pool.submit(_encode, texts)
        return self._thread.submit(self._codec.encode, texts)

    def map(self, batches: Iterable[Batch], on_wait: Callable[[], None] | None = None
            ) -> Iterator[tuple[Batch, np.ndarray, np.ndarray]]:
        """(batch, token ids, document lengths) per batch, in order; ``on_wait`` is called every
        ``wait_s`` while the main thread waits for one."""
        try:
            for b in batches:
                self._window.append((b, self._submit(b.texts)))
                if len(self._window) >= self.depth:
                    yield self._next(on_wait)
            while self._window:
                yield self._next(on_wait)
        except BrokenProcessPool:
            raise MscaleError("a tokenizer worker process died (killed, out of memory, or it "
                              "could not start)",
                              field="--workers",
                              fix="rerun; with less memory per worker, pass fewer --workers"
                              ) from None

    def _next(self, on_wait: Callable[[], None] | None) -> tuple[Batch, np.ndarray, np.ndarray]:
        b, fut = self._window[0]
        # wait(), not result(timeout): an encode that raised a TimeoutError of its own would
        # read as "not yet" for ever
        while not wait([fut], timeout=self.wait_s).done:
            if on_wait is not None:
                on_wait()
        flat, lengths = fut.result()
        self._window.popleft()
        return b, flat, lengths

    def close(self) -> None:
        """After success: nothing is in flight; the workers exit."""
        if self._pool is not None:
            self._pool.shutdown(wait=True)
        self._release()

    def abort(self) -> None:
        """On an error or an interruption: worker processes are terminated at once, not waited
        for (a batch of one large document takes minutes); the daemon thread is abandoned."""
        self._window.clear()
        if self._pool is not None:
            terminate_workers(self._pool)
        self._release()

    def _release(self) -> None:
        if self._thread is not None:
            self._thread.stop()
            self._thread = None
            if self._saved_env is None:
                os.environ.pop("TOKENIZERS_PARALLELISM", None)
            else:
                os.environ["TOKENIZERS_PARALLELISM"] = self._saved_env


def terminate_workers(pool: ProcessPoolExecutor, wait_s: float = TERMINATE_WAIT_S) -> None:
    """Stop ``pool`` now: its queued work cancelled, its processes sent SIGTERM (their default
    action: they ignore only SIGINT) and reaped. ``ProcessPoolExecutor.terminate_workers`` does
    this from Python 3.14; before, the same by hand on its processes."""
    if hasattr(pool, "terminate_workers"):
        pool.terminate_workers()
        return
    processes = list((pool._processes or {}).values())  # shutdown empties the mapping
    pool.shutdown(wait=False, cancel_futures=True)
    for p in processes:
        try:
            p.terminate()
        except (ProcessLookupError, ValueError):  # gone already, or closed
            pass
    deadline = time.monotonic() + wait_s
    for p in processes:
        try:
            p.join(max(0.0, deadline - time.monotonic()))
        except ValueError:
            pass


def default_workers() -> int:
    try:
        return max(1, len(os.sched_getaffinity(0)))
    except AttributeError:  # not Linux
        return max(1, os.cpu_count() or 1)
