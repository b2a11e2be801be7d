"""Pins: checkpoints that retention must keep, because a rollback may still need them.

Retention keeps the newest ``keep`` committed checkpoints, which is right for a run that only
moves forward. A rollback breaks that: `recover` resumes from an *older* checkpoint (the last one
before a divergence), and the relaunch's own saves would push it out of the window after
``keep`` saves, so a second divergence in the replayed window would find nothing to return to.
Two rules protect such checkpoints (`protected`, honoured by `mscale.ckpt.commit.retain`):

1. **A pin**: a small ``KEEP`` file inside the checkpoint directory (JSON: reason, who, time).
   `recover` pins the checkpoint it resumes from, watch pins the one it names for a divergence.
   It lives with the checkpoint, so it moves with it (``abandoned-…``) and needs no index; a
   ``KEEP`` that cannot be parsed still pins (a file of that name means keep).
2. **An open episode**: a ``nan``, ``divergence`` or ``grad_spike`` event in ``events.jsonl``
   recorded in the current attempt (after the last ``start`` of train) and not yet answered by
   a ``recover`` event (one that did not refuse: severity below critical). The newest committed
   checkpoint before the episode's first bad step is kept, so nothing is lost in the window
   between the alarm and `recover` pinning its choice. Once the run restarts (a new ``start``)
   or recover has decided, rule 1 takes over.

Pins are never removed automatically: ``mscale ckpt unpin`` (`unpin`, or deleting ``KEEP``)
releases one; ``mscale ckpt ls`` shows them.
"""

from __future__ import annotations

import time
from dataclasses import asdict, dataclass, replace

from mscale.ckpt import catalog, untrusted
from mscale.ckpt.limits import MAX_SMALL_BYTES
from mscale.ckpt.manifest import COMMITTED, MANIFEST
from mscale.errors import MscaleError
from mscale.runs.atomic import fs_and_path, read_jsonl, write_json_atomic

KEEP = "KEEP"
"""Name of the pin file inside a checkpoint directory."""
EPISODE_KINDS = ("nan", "divergence", "grad_spike")
"""Event kinds that open an episode a rollback may have to go back before."""


@dataclass
class Pin:
    """What a ``KEEP`` file says."""

    reason: str
    """Why the checkpoint is kept, in one sentence."""
    who: str
    """Who pinned it (``recover``, ``watch``, a user name)."""
    time: float
    """Unix time it was pinned."""


def target(path: str) -> str:
    """The checkpoint directory a pin command acts on: ``path``, or for a ``latest`` pointer file
    the checkpoint it names now (the pin stays on that step when ``latest`` moves on)."""
    fs, p = fs_and_path(path)
    if catalog.basename(p) == catalog.LATEST and fs.isfile(p):
        return catalog.resolve(path)
    return path


def pin(ckpt: str, reason: str, who: str, now: float | None = None) -> Pin:
    """Pin the committed checkpoint directory ``ckpt`` (written atomically; pinning twice
    replaces the reason). An uncommitted directory is refused: the next start removes it
    whatever it holds, so a pin there would promise what it cannot keep."""
    fs, path = fs_and_path(ckpt)
    if not fs.exists(fs_and_path(catalog.join(ckpt, COMMITTED))[1]):
        raise MscaleError("not a committed checkpoint (no COMMITTED marker): cannot pin it",
                          file=ckpt, fix="pin a committed step-NNNNNN directory "
                                         "(mscale ckpt ls lists them)")
    if not reason.strip():  # `ls` shows a pin by its reason: a blank one is a pin unseen
        raise MscaleError("a pin needs a reason: `mscale ckpt ls` shows the pin by it, and a "
                          "blank one leaves the checkpoint kept with nothing in the list to "
                          "say so", field="--reason",
                          fix='say why it is kept, e.g. --reason "before the LR change"')
    p = Pin(reason=reason, who=who, time=time.time() if now is None else now)
    write_json_atomic(catalog.join(ckpt, KEEP), asdict(p))
    return p


def unpin(ckpt: str) -> bool:
    """Remove the pin; True when there was one. Bad input (exit 3) unless ``ckpt`` is a
    checkpoint directory: a mistyped path must not read as "was not pinned"."""
    fs, where = fs_and_path(catalog.join(ckpt, MANIFEST))
    if not fs.isfile(where):
        raise MscaleError("not a checkpoint directory (no manifest.json)", file=ckpt,
                          fix="pass a step-NNNNNN directory (mscale ckpt ls lists them)")
    fs, path = fs_and_path(catalog.join(ckpt, KEEP))
    if not fs.exists(path):
        return False
    fs.rm(path)
    return True


def read_pin(ckpt: str) -> Pin | None:
    """The pin of ``ckpt``, or None. A ``KEEP`` that is not the JSON `pin` writes still pins
    (reason says so); one that is not a regular file or too large raises like any damaged file."""
    data = catalog.read_bytes(catalog.join(ckpt, KEEP))
    if data is None:
        return None
    try:
        doc = untrusted.load_json(data, catalog.join(ckpt, KEEP), "pin", MAX_SMALL_BYTES)
        pin = Pin(reason=str(doc["reason"]), who=str(doc["who"]), time=float(doc["time"]))
    except (MscaleError, ValueError, KeyError, TypeError):
        return Pin(reason="KEEP file present (not readable as a pin record)", who="unknown",
                   time=0.0)
    # A blank reason (written before `pin` refused one, or by hand) still pins: said so, or
    # `ls` would show the kept checkpoint as unpinned.
    return pin if pin.reason.strip() else replace(pin, reason="(no reason given)")


def is_pinned(ckpt: str) -> bool:
    fs, path = fs_and_path(catalog.join(ckpt, KEEP))
    return fs.exists(path)


def pinned(ckpt_root: str) -> list[str]:
    """Names of the step-NNNNNN directories under ``ckpt_root`` that carry a pin."""
    return [e.name for e in catalog.entries(ckpt_root, sizes=False)
            if is_pinned(catalog.join(ckpt_root, e.name))]


def first_bad_step(event: dict) -> int | None:
    """First bad step of an episode event: watch's ``first_bad_step``/``first_step`` evidence,
    else the event's step (train's NaN event names the step that went bad)."""
    ev = event.get("evidence") or {}
    for value in (ev.get("first_bad_step"), ev.get("first_step"), event.get("step")):
        if isinstance(value, int) and not isinstance(value, bool):
            return value
    return None


def open_episodes(events: list[dict]) -> list[dict]:
    """Episode events of the current attempt that no ``recover`` decision has answered yet (an
    unrecoverable one, severity critical, pinned nothing: the episode stays open)."""
    out: list[dict] = []
    for ev in events:
        kind = ev.get("kind")
        if kind == "start" and ev.get("source", "train") == "train":
            out = []  # a restart: recover (or a human) has chosen where the run continues
        elif kind == "recover" and ev.get("severity") != "critical":
            out = []  # recover decided and pinned what it resumes from (critical: it refused)
        elif kind in EPISODE_KINDS and first_bad_step(ev) is not None:
            out.append(ev)
    return out


def events_of(ckpt_root: str) -> str | None:
    """``events.jsonl`` of the run that owns ``ckpt_root`` (RUN/ckpt), or None elsewhere."""
    if catalog.basename(ckpt_root) != "ckpt":
        return None
    return catalog.join(catalog.parent(ckpt_root), "events.jsonl")


def protected(ckpt_root: str, found: list[catalog.Entry] | None = None) -> dict[str, str]:
    """name → why, for every checkpoint retention must keep (the module docstring's rules).

    An ``events.jsonl`` that cannot be read protects every committed checkpoint: retention then
    deletes nothing until it can tell which ones a rollback needs."""
    found = catalog.entries(ckpt_root, sizes=False) if found is None else found
    keep = {e.name: "pinned" for e in found if is_pinned(catalog.join(ckpt_root, e.name))}
    url = events_of(ckpt_root)
    if url is None:
        return keep
    try:
        episodes = open_episodes(read_jsonl(url))
    except (MscaleError, OSError, ValueError) as exc:
        why = f"events.jsonl unreadable ({exc}); nothing is deleted until it reads"
        return {**{c.name: why for c in found if c.committed}, **keep}
    committed = [e for e in found if e.committed]
    for ev in episodes:
        bad = first_bad_step(ev)
        before = [e for e in committed if e.step < bad]
        if before:
            keep.setdefault(before[-1].name, f"newest checkpoint before the open {ev['kind']} "
                                             f"episode at step {bad}")
    return keep
