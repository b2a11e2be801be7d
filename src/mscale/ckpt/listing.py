"""What ``mscale ckpt ls`` reports about a run's checkpoints, and how ckpt's commands write a
size and a layout.

The rules live here, not in the CLI, so that the command only parses, calls and prints: each
checkpoint directory's status (committed, partial, or one a warning explains), its pin with the
fallback for a ``KEEP`` that cannot be read (it still pins: retention keeps it), and the warnings
that make ``ls`` exit 1. Not in `catalog`, which lists the directories: `pins` imports it.
"""

from __future__ import annotations

from dataclasses import asdict, dataclass, field

from mscale.ckpt import catalog
from mscale.ckpt.manifest import COMMITTED, MANIFEST
from mscale.ckpt.pins import read_pin
from mscale.errors import MscaleError
from mscale.runs.atomic import fs_and_path

UNREADABLE_PIN = {"reason": "KEEP present but unreadable", "who": "unknown", "time": 0.0}
"""The pin ``ls`` shows for a ``KEEP`` that is a directory, too large or unreadable."""


def format_bytes(n: float) -> str:
    """A size in decimal units, as every ckpt command prints it: ``512 B``, ``3.1 MB``,
    ``1.2 TB`` (one decimal from kB on; TB is the largest unit)."""
    for unit in ("B", "KB", "MB", "GB"):
        if n < 1000:
            return f"{n:.0f} {unit}" if unit == "B" else f"{n:.1f} {unit}"
        n /= 1000
    return f"{n:.1f} TB"


def layout_text(layout: dict | None) -> str:
    """A manifest's layout in one word group, ``tp2 pp2 v2 dp2 zero1`` (``v``: virtual stages
    per pipeline rank, shown when more than one); ``-`` when unknown."""
    if not layout:
        return "-"
    vpp = f" v{layout['vpp']}" if layout.get("vpp", 1) > 1 else ""
    return (f"tp{layout['tp']} pp{layout['pp']}{vpp} dp{layout['dp']} "
            f"zero{layout['zero_stage']}")


@dataclass
class Listing:
    """A run's checkpoints as ``ls`` shows them; ``--json`` is `to_json`."""

    run: str
    latest: str | None
    """The directory ``latest`` names (None: none, or unreadable, which a warning says)."""
    checkpoints: list[dict] = field(default_factory=list)
    """One `row` per step directory, oldest first."""
    warnings: list[str] = field(default_factory=list)
    """What needs a look; any makes ``ls`` exit 1."""
    checkpoint: str | None = None
    """The one checkpoint listed when ``ls`` was given a checkpoint, not a run (`one_given`)."""
    run_dir: str | None = None
    """With ``checkpoint``: the run directory it belongs to (``ls RUN_DIR`` lists them all),
    None when it lies in no run's ``ckpt/``."""

    def to_json(self) -> dict:
        return asdict(self)


def ckpt_root(run_dir: str) -> str:
    """The ``ckpt/`` directory of ``run_dir`` (or ``run_dir`` itself when it is one); bad input
    (exit 3) when there is none."""
    fs_and_path(run_dir)  # an unknown protocol is named as the user typed it
    root = run_dir if catalog.basename(run_dir) == "ckpt" else catalog.join(run_dir, "ckpt")
    fs, path = fs_and_path(root)
    if not fs.isdir(path):
        gone = not fs.exists(fs_and_path(run_dir)[1])
        raise MscaleError("no such directory" if gone else "no ckpt/ directory here",
                          file=run_dir, fix="pass a run directory that `mscale train --run-dir` "
                                            "wrote (RUN_DIR), or one checkpoint in it "
                                            "(RUN_DIR/ckpt/step-NNNNNN)")
    return root


def one_given(path: str) -> str | None:
    """The checkpoint directory when ``path`` names one checkpoint rather than a run: a
    ``step-NNNNNN`` directory or any directory holding a manifest or commit marker, its
    ``manifest.json``, or a ``latest`` pointer (what it names). None for anything else (a run,
    its ``ckpt/``): `ckpt_root` then says what is wrong."""
    fs, p = fs_and_path(path)
    name = catalog.basename(p)
    if fs.isdir(p):
        if name == "ckpt" or fs.isdir(catalog.join(p, "ckpt")):
            return None
        if catalog.STEP_DIR.match(name) or any(fs.exists(catalog.join(p, f))
                                               for f in (MANIFEST, COMMITTED)):
            return path
        return None
    if name in (MANIFEST, catalog.LATEST) and fs.exists(p):
        return catalog.resolve(path)  # a bad pointer is named as one
    return None


def list_one(given: str, ckpt: str) -> Listing:
    """``ls`` of one checkpoint (`one_given`): its row, with ``latest`` read beside it, and the
    warnings about it alone; the run's own warnings are for ``ls RUN_DIR``."""
    root, name = catalog.parent(ckpt), catalog.basename(ckpt)
    try:
        latest = catalog.read_latest(root)
    except MscaleError:  # a damaged pointer beside it: ``ls RUN_DIR`` says so
        latest = None
    r = row(catalog.entry(root, name), latest, root)
    run = catalog.parent(root) if catalog.basename(root) == "ckpt" else None
    return Listing(run=given, latest=latest, checkpoints=[r], checkpoint=ckpt, run_dir=run,
                   warnings=[f"{r['name']}: {r['note']}"] if r["note"] else [])


def list_checkpoints(run_dir: str) -> Listing:
    """Every checkpoint of a run with its status and pin, and the warnings: a ``latest`` that
    cannot be read or names no committed checkpoint here, a committed checkpoint newer than
    ``latest`` or no ``latest`` at all (a resume then loads another: `catalog.auto_choice`), a
    manifest that cannot be read, a directory whose name and manifest disagree on the step, a
    ``KEEP`` that cannot be read. Given one checkpoint instead of a run, that one alone
    (`list_one`)."""
    one = one_given(run_dir)
    if one is not None:
        return list_one(run_dir, one)
    root = ckpt_root(run_dir)
    listing = Listing(run=run_dir, latest=None)
    readable = True
    try:
        listing.latest = catalog.read_latest(root)
    except MscaleError as e:
        listing.warnings.append(str(e))
        readable = False
    found = catalog.entries(root)
    listing.checkpoints = [row(e, listing.latest, root) for e in found]
    auto = catalog.auto_choice(found, listing.latest)
    if readable and auto != listing.latest:  # a newer committed one, or none: a resume loads it
        said = (f"names {listing.latest}, but {auto} is committed and newer" if listing.latest
                else f"is missing; {auto} is the newest committed checkpoint")
        listing.warnings.append(f"{catalog.join(root, catalog.LATEST)} {said} (a crash between "
                                "a commit and its pointer?): `mscale train --resume auto`, and "
                                f"ckpt verify and convert of the run, use {auto}")
    named = next((r for r in listing.checkpoints if r["latest"]), None)
    if listing.latest and not (named and named["status"] == "committed"):
        # a marker over a manifest that fails its checks was committed, then damaged or edited
        why = ("whose manifest cannot be used (its warning below)"
               if named and named["status"].startswith("committed") else
               "which is not a committed checkpoint here")
        listing.warnings.append(f"{catalog.join(root, catalog.LATEST)} names {listing.latest}, "
                                f"{why}; `mscale train` will refuse to resume (resume from an "
                                "older one: --resume RUN/ckpt/step-NNNNNN)")
    listing.warnings += [f"{r['name']}: {r['note']}" for r in listing.checkpoints if r["note"]]
    return listing


def row(e: catalog.Entry, latest: str | None, root: str) -> dict:
    """One checkpoint: the step is the directory's; ``note`` says when the manifest disagrees or
    cannot be read (the status then says "see warning"); ``pin`` is its KEEP record (retention
    keeps it), `UNREADABLE_PIN` for a damaged one, or None."""
    note = None
    if e.problem:
        note = f"manifest.json cannot be used: {e.problem}"
    elif e.manifest_step is not None and e.manifest_step != e.step:
        note = f"its manifest is at step {e.manifest_step}, not the {e.step} its name says"
    status = "committed" if e.committed else "partial"
    if note:
        status += " (see warning)"
    try:
        pin = read_pin(catalog.join(root, e.name))
        pin = asdict(pin) if pin else None
    except MscaleError as err:  # a KEEP that is a directory, too large, unreadable: still a pin
        pin = dict(UNREADABLE_PIN)
        note = note or f"its KEEP file cannot be read ({err.message}); retention keeps it"
    return {"name": e.name, "step": e.step, "manifest_step": e.manifest_step, "status": status,
            "bytes": e.bytes, "layout": e.layout, "latest": e.name == latest, "note": note,
            "pin": pin}
