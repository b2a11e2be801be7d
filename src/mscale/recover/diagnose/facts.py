"""Turn a run's evidence into findings: each a rule of `mscale.recover.diagnose.rules` with the line
that matched it, the rank and node it concerns, and its time and step.

Sources, in the order they are read: the attempt's events (the launcher's stop/hang, train's
stop, nan and checkpoint events, watch's findings), the per-rank error files, torchelastic error
files, rank logs (bounded: `MAX_LOG_SCANS` of them, the failed ranks first) and SLURM output.
"""

from __future__ import annotations

import os
import re

from mscale.recover.diagnose.evidence import RunEvidence
from mscale.recover.diagnose.findings import Findings, Hit
from mscale.recover.diagnose.rules import CKPT_DAMAGE, CKPT_DIR, SPIKE_GAP_STEPS
from mscale.recover.diagnose.slurm import slurm_output, teardown

MAX_LOG_SCANS = 64
"""Rank logs searched at most: the failed and suspect ranks first, then rank order."""
_CONSOLE_ERROR = re.compile(r"^error \(rank \d+ on ")
"""The one line a failing worker prints (train/worker.py), which its error file also holds."""
_OWN_LINE = re.compile(r"^(training \S+: |step \d+/\d+ |starting \d+ workers|resumed from |done: |"
                       r"checkpoint step-\d+ committed )")
"""train's own progress lines (they quote paths such as the run directory, never a failure)."""
_FRAME = re.compile(r'^\s*File "([^"]+)", line \d+, in (\S+)')
_EXC_LINE = re.compile(r"^([A-Za-z_][\w.]*(Error|Exception|Interrupt|Exit|Warning)|"
                       r"[A-Za-z_][\w.]*Error)\b(:.*)?$")
_USER_ERRORS = ("TypeError", "NameError", "AttributeError", "ImportError",
                "ModuleNotFoundError", "SyntaxError", "IndentationError")
_FRAMEWORK = re.compile(r"/(site-packages|dist-packages|lib/python\d[\d.]*)/|/mscale/|^<")


def find(ev: RunEvidence) -> list[Hit]:
    """Every finding of the last attempt (module docstring)."""
    f = Findings(ev)
    _events(f)
    _error_files(f)
    _elastic(f)
    _logs(f)
    after_failure = slurm_output(f)
    teardown(f, after_failure)
    return f.hits


# -- events ---------------------------------------------------------------------------------


def _events(f: Findings) -> None:
    spikes: list[tuple[int, dict]] = []
    for e in f.ev.attempt.events:
        try:
            _event(f, e, spikes)
        except (TypeError, ValueError, AttributeError, KeyError) as exc:  # a damaged record
            f.ev.problem("events.jsonl", f"an event of kind {e.get('kind')!r} could not be "
                                         f"read: {type(exc).__name__}: {exc}")
    _spikes(f, spikes)
    _quarantined(f)


def _event(f: Findings, e: dict, spikes: list[tuple[int, dict]]) -> None:
    """One event of the attempt: a finding, or a spike kept for `_spikes`."""
    kind, src = e.get("kind"), e.get("source", "train")
    evd = e.get("evidence") if isinstance(e.get("evidence"), dict) else {}
    when = e.get("time") if isinstance(e.get("time"), (int, float)) else None
    step = e.get("step") if isinstance(e.get("step"), int) else None
    onset = evd.get("first_step") if src == "watch" else None  # watch's own "step N" is this
    at = (f" at step {step}" if step else "") + (
        f" (since step {onset})" if isinstance(onset, int) and onset != step else "")
    digest = f"{src} {kind}{at}: {e.get('message', '')}"
    if kind == "stop" and src == "train":
        _stop(f, e, evd, digest)
    elif kind == "hang":
        _hang(f, e, evd, digest)
    elif kind == "nan":
        first = evd.get("first_step") if src == "watch" else None
        f.add("nan", "events.jsonl", digest, time=when, step=first or step)
    elif kind == "divergence":
        first = evd.get("first_bad_step") or evd.get("first_step") or step
        f.add("divergence", "events.jsonl", digest, time=when, step=first)
    elif kind == "grad_spike":
        spikes.append((int(evd.get("first_step") or step or 0), e))
    elif kind == "straggler" and evd.get("cause") in ("slow_device", "slow_node",
                                                        "slow_link"):
        key = "slow_link" if evd.get("cause") == "slow_link" else "straggler"
        for r in e.get("ranks") or [None]:
            f.add(key, "events.jsonl", digest, rank=r, time=when, step=step)
    elif kind == "checkpoint_failed":
        f.add("ckpt_failed", "events.jsonl", digest, time=when, step=step)
        errors = evd.get("errors") if isinstance(evd.get("errors"), dict) else {}
        f.text("events.jsonl", digest, time=when)  # the same line: one evidence line, not two
        for line in {str(evd.get("error", "")), *map(str, list(errors.values())[:1])}:
            if line and line not in digest:  # one rank's error, when the message lacks it
                f.text("events.jsonl", line, time=when)


def _quarantined(f: Findings) -> None:
    """A node quarantine.json took in during this attempt (watch's checkpoint-then-quarantine,
    or an operator): the job was stopped to drop it, whatever its stop says."""
    for entry in (f.ev.quarantine or {}).get("entries") or []:
        if not isinstance(entry, dict) or not isinstance(entry.get("node"), str):
            continue
        since = entry.get("since")
        if f.ev.attempt.begins is None or not isinstance(since, (int, float)) \
                or since <= f.ev.attempt.begins:
            continue
        hit = f.add("straggler", "quarantine.json", f"{entry['node']} quarantined: "
                    f"{entry.get('reason', '')}", time=since)
        hit.evidence.node = entry["node"]


OPERATOR_SIGNALS = ("SIGINT", "SIGHUP")
"""The stop signals an operator sends (Ctrl-C; a closed terminal or ssh session), also when the
``--local`` launcher passed them on: a stop on request, not the scheduler's SIGTERM/SIGUSR1."""


def _stop(f: Findings, e: dict, evd: dict, digest: str) -> None:
    """train's own stop (a ``code``) or the launcher's view of a failure (``first_failed_rank``)."""
    when = e.get("time")
    if "first_failed_rank" in evd:
        rank, how = evd.get("first_failed_rank"), str(evd.get("how", ""))
        if "SIGTERM" in how or "SIGINT" in how or "SIGHUP" in how:
            f.add("terminated", "events.jsonl", digest, rank=rank, time=when)
        elif how.startswith("killed"):
            f.add("killed", "events.jsonl", digest, rank=rank, time=when)
        elif rank not in f.ev.error_files:
            f.add("exit_nonzero", "events.jsonl", digest, rank=rank, time=when)
        return
    code = evd.get("code")
    if evd.get("reason") == "interrupted":  # the --local launcher: the operator's Ctrl-C
        f.add("interrupted", "events.jsonl", digest, time=when, step=e.get("step"))
    elif code == 0:
        f.add("finished", "events.jsonl", digest, time=when, step=e.get("step"))
    elif code == 1:  # a Ctrl-C or a closed terminal is the operator's request, as a halt is
        key = "signalled" if evd.get("reason") == "signal" \
            and evd.get("signal") not in OPERATOR_SIGNALS else "halted"
        f.add(key, "events.jsonl", digest, time=when, step=e.get("step"))
    elif code not in (2, None) and not f.ev.error_files:
        f.add("exit_nonzero", "events.jsonl", digest, rank=(e.get("ranks") or [None])[0],
              time=when)


def _hang(f: Findings, e: dict, evd: dict, digest: str) -> None:
    """A hang as the launcher saw it names the hung ranks; rank 0's own hang event (srun,
    torchrun) and watch's name none: `mscale.recover.diagnose.hang` looks for them."""
    named = e.get("ranks") if "first_failed_rank" in evd else []
    f.add("hang", "events.jsonl", digest, rank=(named or [None])[0], time=e.get("time"),
          step=e.get("step"), ranks=tuple(named or ()))


def _spikes(f: Findings, spikes: list[tuple[int, dict]]) -> None:
    """Two or more gradient spikes within `SPIKE_GAP_STEPS` of each other, ending with the last:
    one episode, which begins at its first spike."""
    steps = sorted({s for s, _ in spikes if s > 0})
    if len(steps) < 2:
        return
    episode = [steps[-1]]
    for s in reversed(steps[:-1]):
        if episode[0] - s > SPIKE_GAP_STEPS:
            break
        episode.insert(0, s)
    if len(episode) >= 2:
        last = max(spikes, key=lambda sp: sp[0])[1]
        f.add("spikes", "events.jsonl", f"{len(episode)} gradient-norm spikes at steps "
              f"{', '.join(map(str, episode))}: {last.get('message', '')}",
              time=last.get("time"), step=episode[0])


# -- files ----------------------------------------------------------------------------------


def _error_files(f: Findings) -> None:
    for rank, rec in sorted(f.ev.error_files.items(), key=lambda kv: (_time(kv[1]), kv[0])):
        try:
            _error_file(f, rank, rec)
        except (TypeError, ValueError, AttributeError) as exc:  # a damaged record
            f.ev.problem(str(rec.get("_source")), f"could not be read: {exc}")


def _error_file(f: Findings, rank: int, rec: dict) -> None:
    """One rank's error file (train/failure.py): its kind, and its message and last exception line
    searched with the text rules."""
    source, when = rec.get("_source", f"logs/rank{rank}.error.json"), _time(rec)
    message = str(rec.get("message", ""))
    kind = rec.get("kind")
    exc_line, frames = last_exception(str(rec.get("traceback", "")).splitlines())
    line = f"{kind}: {message}"
    damaged = damaged_checkpoint(rec.get("file"), message) if kind == "bad_input" else None
    if kind == "crash" and _user_raised(exc_line or message, frames):
        f.add("user_frame", source, f"{line} (in {frames[-1]})", rank, when)
    elif damaged is not None:
        hit = f.add("ckpt_damaged", source, line, rank, when)
        hit.checkpoint, hit.checkpoint_error = damaged
    elif kind in ("bad_input", "disk_full", "timeout", "network", "console", "launcher_died",
                  "crash"):
        f.add(kind, source, line, rank, when)
    for text in {message, exc_line or ""} - {""}:
        f.text(source, text, rank, when)


def damaged_checkpoint(file: object, message: str) -> tuple[str, str] | None:
    """``(checkpoint directory, what was wrong)`` when a ``bad_input`` error is a damaged
    checkpoint file the resume read (`rules.CKPT_DAMAGE`), else None. The directory is taken
    from the error's ``file`` when the record has one (the `MscaleError`'s own field), else from
    the message, which train writes as ``FILE: FIELD: MESSAGE; fix: FIX``."""
    if not CKPT_DAMAGE.search(message):
        return None
    for where in (file, message):
        if isinstance(where, str) and (m := CKPT_DIR.search(where)):
            path = m.group("dir")
            what = message.split("; fix: ", 1)[0].replace(f"{path}/", "", 1)
            return path, " ".join(what.split())[:300]
    return None


def _time(rec: dict) -> float:
    t = rec.get("time") if isinstance(rec, dict) else None
    return float(t) if isinstance(t, (int, float)) else float("inf")


def _elastic(f: Findings) -> None:
    for info, rec in f.ev.elastic:
        msg = rec.get("message")
        if isinstance(msg, dict):
            text = str(msg.get("message", ""))
            stack = str((msg.get("extraInfo") or {}).get("py_callstack", ""))
        else:
            text, stack = str(msg or ""), ""
        rank = _rank_in_path(info.source)
        exc_line, frames = last_exception(stack.splitlines())
        first = (text.strip().splitlines() or [""])[0]
        if _user_raised(exc_line or first, frames):
            f.add("user_frame", info.source, f"{first} (in {frames[-1]})", rank, info.mtime)
        else:
            f.add("crash", info.source, exc_line or first, rank, info.mtime)
        for line in {first, exc_line or ""} - {""}:
            f.text(info.source, line, rank, info.mtime)


def _rank_in_path(path: str) -> int | None:
    m = re.search(r"rank[_-]?(\d+)", path)
    return int(m.group(1)) if m else None


def _logs(f: Findings) -> None:
    ev = f.ev
    first = [h.evidence.rank for h in f.hits if h.evidence.rank is not None]
    order = list(dict.fromkeys([*first, *sorted(ev.error_files), 0, *sorted(ev.logs)]))
    for rank in [r for r in order if r in ev.logs][:MAX_LOG_SCANS]:
        info = ev.logs[rank]
        lines = ev.lines(info)
        echoed = rank in ev.error_files  # its console line repeats the error file
        for line in lines:
            if not (echoed and _CONSOLE_ERROR.match(line)) and not _OWN_LINE.match(line):
                f.text(info.source, line, rank, info.mtime)
        exc_line, frames = last_exception(lines)
        if exc_line and rank not in ev.error_files:  # an error file already says it
            key = "user_frame" if _user_raised(exc_line, frames) else "crash"
            f.add(key, info.source, exc_line, rank, info.mtime)


# -- tracebacks -----------------------------------------------------------------------------


def last_exception(lines: list[str]) -> tuple[str | None, list[str]]:
    """The exception line that ends the last Python traceback in ``lines``, and the files of
    its frames, innermost last."""
    start = max((i for i, ln in enumerate(lines) if ln.startswith("Traceback (most recent")),
                default=None)
    if start is None:
        return None, []
    frames = []
    for ln in lines[start + 1:]:
        if m := _FRAME.match(ln):
            frames.append(m.group(1))
        elif ln and not ln[0].isspace():
            return (ln.strip() if _EXC_LINE.match(ln.strip()) else ln.strip()), frames
    return None, frames


def _user_raised(exc_line: str, frames: list[str]) -> bool:
    """A TypeError/NameError/ImportError/... whose innermost frame is the user's own file (not
    the standard library, an installed package or mscale)."""
    name = exc_line.split(":", 1)[0].rsplit(".", 1)[-1].strip()
    if name not in _USER_ERRORS or not frames:
        return False
    return not _FRAMEWORK.search(frames[-1].replace(os.sep, "/"))
