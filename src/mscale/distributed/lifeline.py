"""A ``--local`` worker never outlives its launcher.

The launcher (`run_local_workers`) holds the run's lock, tees rank 0's output, stops the job when
a worker fails and writes the stop event: workers that go on training without it are
unsupervised, write into a run directory whose lock names a dead process (a relaunch may take it
over while they write), and die at rank 0's next console line with nobody to say why. So each
worker watches its launcher and stops as soon as it is gone, however it went (SIGKILL, the OOM
killer, a crash).

How: the launcher listens on a Unix socket for the whole job (`Lifeline`; an abstract name on
Linux, nothing on disk to leave behind; a socket file in a private temporary directory
elsewhere) and gives its address to the workers (`LIFELINE_ENV`). Each worker connects once, at
its start, and a daemon thread blocks reading the connection (`watch_launcher`). Nothing is ever
sent on it but single bytes: `ALIVE`, once the launcher has seen a worker end, and a `STOP_SAID`
byte naming the operator's stop signal before the launcher passes it on as SIGTERM (rank 0's
closing line and stop event name the SIGINT or SIGHUP the operator sent). The read returns
empty only when the launcher's process is gone — the kernel closes a process's sockets however
it dies — so a worker knows at once, without polling. A launcher gone before a worker connects
refuses the connection: the same verdict, at once.

Why the byte: a worker whose collective fails because a peer died asks whether the launcher is
gone too (a dead launcher's workers stop themselves, and their peers see only a lost
connection). Without an answer it could only wait for the end-of-file that never comes, up to
`train.worker.LAUNCHER_CONFIRM_S`, and each hop of a failure (rank 5 dies, its peers wait and
exit, their peers wait...) added that wait again: 6 s from a killed worker to the job's end at
world 8. The launcher sees a worker's end within a poll and says so.

Why not the alternatives:

- ``prctl(PR_SET_PDEATHSIG)`` and polling ``os.getppid()`` watch the *parent*, and a forked
  worker's parent is the fork server (distributed/forkserver.py), not the launcher; the fork
  server was seen running on after its launcher was SIGKILLed, its workers with it. PDEATHSIG
  also fires when the parent *thread* that forked ends, and is Linux-only.
- A pipe whose end-of-file means death would need its read end passed through the fork server
  into every worker; the socket is found by its address alone, forked or spawned alike.

Only ``--local`` arms it: `run_local_workers` sets `LIFELINE_ENV` together with
``MSCALE_LAUNCHER=local``, and `watch_launcher` does nothing without both. Under torchrun and srun
the worker's parent is their agent (torchelastic's, slurmstepd), which stops its workers itself.

An armed worker also ignores SIGHUP: a closed terminal sends it to the whole foreground process
group, and the launcher, which receives it too, decides what it means (the same as SIGTERM: a
checkpoint, then a clean stop), and tells the workers with SIGTERM.

No torch here: the launcher imports this module.
"""

from __future__ import annotations

import os
import secrets
import select
import shutil
import signal
import socket
import sys
import tempfile
import threading
from typing import Callable

LIFELINE_ENV = "MSCALE_LIFELINE"
"""The launcher's lifeline address, given to every ``--local`` worker (``@name``: Linux's
abstract namespace)."""

LOG_FILE_ENV = "MSCALE_RANK_LOG"
"""A ``--local`` worker's own log file (``logs/rank<N>.log``), where it says why it stopped: rank
0's stdout is the launcher's pipe, gone with the launcher."""

REPORT_DEADLINE_S = 20.0
"""Most seconds a worker spends saying why it stops (its error file, rank 0's event) before it
exits anyway: a run directory on a stalled filesystem must not keep it alive."""

ALIVE = b"A"
"""What the launcher sends each worker once it has seen a worker end: it is alive, and knows."""

STOP_SAID = {b"I": "SIGINT", b"H": "SIGHUP", b"T": "SIGTERM"}
"""What the launcher sends each worker just before it passes an operator's stop on as SIGTERM:
the signal it got itself. The worker's SIGTERM alone would make a SIGINT or a SIGHUP sent to the
launcher read as a scheduler's stop (a preemption) in rank 0's closing line and stop event."""

ALIVE_RECHECK_S = 0.05
"""How long a worker told ``ALIVE`` still watches for its launcher's end before it believes the
word: a launcher that died just after it would otherwise read as a network fault here while the
watch thread reports the launcher's death. The kernel closes a dead process's socket at once and
the watch thread is blocked in its read, so a few scheduler ticks are enough; each hop of a
failure pays it once."""

EXIT_CODE = 3
"""A worker that stopped because its launcher is gone exits 3 ("could not run"); nobody is left
to read it, but the contract holds."""


class Lifeline:
    """The launcher's end: a listening socket that lives exactly as long as the launcher.

    `accept` takes the workers' connections and keeps them open; the watcher calls it between
    polls (no thread). `close` at the end of the job."""

    def __init__(self, backlog: int = 64):
        self._sock = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
        self._dir: str | None = None
        try:
            if sys.platform.startswith("linux"):
                name = f"mscale-lifeline-{os.getpid()}-{secrets.token_hex(8)}"
                self._sock.bind("\0" + name)
                self.address = "@" + name
            else:
                self._dir = tempfile.mkdtemp(prefix="mscale-")
                self.address = os.path.join(self._dir, "lifeline")
                self._sock.bind(self.address)
            self._sock.listen(max(1, min(backlog, 4096)))
            self._sock.setblocking(False)
        except BaseException:
            self.close()
            raise
        self._conns: list[socket.socket] = []
        self._told = False
        self._stop: bytes | None = None  # `tell_stop`'s byte, for workers that connect later

    def accept(self) -> int:
        """Accept the connections waiting; returns how many are held."""
        while True:
            try:
                ready, _, _ = select.select([self._sock], [], [], 0)
                if not ready:
                    break
                conn, _ = self._sock.accept()
            except (BlockingIOError, InterruptedError):
                break
            except OSError:  # closed
                break
            self._conns.append(conn)
            if self._told:  # a worker that connects after the word gets it too
                _send(conn, ALIVE)
            if self._stop:
                _send(conn, self._stop)
        return len(self._conns)

    def tell_alive(self) -> None:
        """Tell every worker connected that the launcher is alive and has seen a worker end
        (module docstring). Once: later calls do nothing. Never blocks, never raises."""
        if self._told:
            return
        self.accept()
        self._told = True
        for conn in self._conns:
            _send(conn, ALIVE)

    def tell_stop(self, name: str) -> None:
        """Tell every worker which stop signal the launcher got (`STOP_SAID`), before it sends
        them SIGTERM; once. Never blocks, never raises."""
        said = next((b for b, n in STOP_SAID.items() if n == name), None)
        if said is None or self._stop is not None:
            return
        self.accept()
        self._stop = said
        for conn in self._conns:
            _send(conn, said)

    def close(self) -> None:
        for s in [*getattr(self, "_conns", []), self._sock]:
            try:
                s.close()
            except OSError:
                pass
        if self._dir:
            shutil.rmtree(self._dir, ignore_errors=True)

    def __enter__(self) -> "Lifeline":
        return self

    def __exit__(self, *exc) -> None:
        self.close()


def _send(conn: socket.socket, word: bytes) -> None:
    try:
        conn.send(word, socket.MSG_DONTWAIT)
    except OSError:  # that worker is gone, or its buffer full: it has its answer
        pass


def _connect_address(address: str) -> str:
    return "\0" + address[1:] if address.startswith("@") else address


class LauncherWatch:
    """A worker's end: a connection to the launcher's `Lifeline` and the thread that waits on
    it. ``on_gone(why)`` runs once, on that thread, when the launcher is gone (it normally ends
    the process); `gone` is set just before. `alive` is set when the launcher says it has seen
    a worker end (`Lifeline.tell_alive`); `stop_said` names the stop signal the launcher got
    (`Lifeline.tell_stop`), None until it says one."""

    def __init__(self, address: str, on_gone: Callable[[str], None]):
        self.address, self.on_gone = address, on_gone
        self.gone = threading.Event()
        self.alive = threading.Event()
        self.stop_said: str | None = None
        self._answered = threading.Event()  # gone or alive: what wait_gone waits for
        self._lock = threading.Lock()
        self._fired = False
        self._sock: socket.socket | None = None
        self._thread: threading.Thread | None = None

    def start(self) -> "LauncherWatch":
        sock = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
        try:
            sock.connect(_connect_address(self.address))
        except OSError:
            sock.close()
            why = "is gone: it no longer accepts its workers' connection"
            self._thread = threading.Thread(target=self._fire, args=(why,), daemon=True,
                                            name="mscale-launcher-watch")
        else:
            self._sock = sock
            self._thread = threading.Thread(target=self._wait, args=(sock,), daemon=True,
                                            name="mscale-launcher-watch")
        self._thread.start()
        return self

    def _wait(self, sock: socket.socket) -> None:
        try:
            while words := sock.recv(4096):
                self._heard(words)
        except OSError:
            pass
        self._fire("is gone: its connection to this worker closed")

    def _heard(self, words: bytes) -> None:
        for i in range(len(words)):
            word = words[i:i + 1]
            if word == ALIVE:
                self.alive.set()
                self._answered.set()
            elif word in STOP_SAID:
                self.stop_said = STOP_SAID[word]

    def _fire(self, why: str) -> None:
        with self._lock:
            if self._fired:
                return
            self._fired = True
        self.gone.set()
        self._answered.set()
        self.on_gone(why)

    def wait_gone(self, timeout: float) -> bool:
        """Whether the launcher is gone, waiting up to ``timeout`` s for the watch to see it: a
        peer that stopped because the launcher is gone makes this worker's collective fail a
        moment before this worker's own watch wakes. A launcher that has said it is alive
        (it saw a worker end) answers within `ALIVE_RECHECK_S`: a moment for an end-of-file
        already on its way (a launcher that died after its word) to be seen."""
        if self._answered.wait(timeout) and not self.gone.is_set():
            self.gone.wait(min(timeout, ALIVE_RECHECK_S))
        return self.gone.is_set()

    def close(self) -> None:
        """Stop watching (tests): the thread sees the connection end, and does nothing."""
        with self._lock:
            self._fired = True
        if self._sock is not None:
            try:
                self._sock.shutdown(socket.SHUT_RDWR)
            except OSError:
                pass
            self._sock.close()


def armed(environ: dict[str, str] | None = None) -> bool:
    """Whether this process is a ``--local`` worker with a launcher to watch."""
    env = os.environ if environ is None else environ
    return bool(env.get(LIFELINE_ENV)) and env.get("MSCALE_LAUNCHER") == "local"


def watch_launcher(on_gone: Callable[[str], None] | None = None,
                   environ: dict[str, str] | None = None) -> LauncherWatch | None:
    """Under a ``--local`` launcher: ignore SIGHUP (the launcher decides what a hangup means) and
    watch the launcher; ``on_gone`` (default: `stop_worker`) runs when it is gone. Elsewhere
    (torchrun, srun, a plain process): None, nothing changed. Call it from the main thread."""
    env = os.environ if environ is None else environ
    if not armed(env):
        return None
    if threading.current_thread() is threading.main_thread():
        signal.signal(signal.SIGHUP, signal.SIG_IGN)
    if on_gone is None:
        on_gone = lambda why: stop_worker(  # noqa: E731
            f"error: the --local launcher {why}; this worker stops (a worker never outlives "
            "its launcher)")
    global _WATCH
    _WATCH = LauncherWatch(env[LIFELINE_ENV], on_gone).start()
    return _WATCH


_WATCH: LauncherWatch | None = None
"""This worker's watch (`watch_launcher`), one per process: `launcher_stop_signal` reads it."""


def launcher_stop_signal() -> str | None:
    """The stop signal this worker's ``--local`` launcher said it got (``SIGHUP``), None when
    it said none or there is no launcher to watch."""
    return _WATCH.stop_said if _WATCH is not None else None


def say_in_log(line: str, environ: dict[str, str] | None = None) -> None:
    """Write ``line`` (with its newline) into this worker's log: through stderr when that is the
    log file (ranks 1..N-1), else appended to the file (rank 0, whose output went through the
    launcher). Never raises."""
    env = os.environ if environ is None else environ
    path = env.get(LOG_FILE_ENV)
    data = line.encode(errors="replace")
    try:
        if path and _same_file(2, path):
            sys.stderr.flush()
            os.write(2, data)
            return
    except (OSError, ValueError):
        pass
    if path:
        try:
            fd = os.open(path, os.O_WRONLY | os.O_APPEND | os.O_CREAT, 0o644)
            try:
                os.write(fd, data)
            finally:
                os.close(fd)
            return
        except OSError:
            pass
    try:
        os.write(2, data)
    except OSError:
        pass


def _same_file(fd: int, path: str) -> bool:
    try:
        a, b = os.fstat(fd), os.stat(path)
    except OSError:
        return False
    return (a.st_dev, a.st_ino) == (b.st_dev, b.st_ino)


def exit_after(deadline_s: float, code: int = EXIT_CODE) -> None:
    """End the process in ``deadline_s`` whatever it is doing then (a daemon timer)."""
    t = threading.Timer(deadline_s, os._exit, args=(code,))
    t.daemon = True
    t.start()


def stop_worker(line: str, report: Callable[[], None] | None = None) -> None:
    """A worker whose launcher is gone: ``line`` in its log, ``report`` (its error file and
    event; bounded by `REPORT_DEADLINE_S`), exit 3. No barrier, no group teardown: the peers are
    stopping the same way, and a collective with a stopped peer could only wait for its
    timeout."""
    exit_after(REPORT_DEADLINE_S)
    say_in_log(line if line.endswith("\n") else line + "\n")
    if report is not None:
        try:
            report()
        except Exception as e:  # noqa: BLE001 - the exit still happens
            say_in_log(f"could not record the stop in the run directory: {type(e).__name__}: "
                       f"{e}\n")
    os._exit(EXIT_CODE)
