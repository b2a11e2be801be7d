"""What differs between a checkpoint and the run resuming from it, said before the first step.

A resume continues the data by position (global samples consumed) and the learning rate by
step, under whatever data and schedule the resuming run has. Both can change without any error:

- **the data**: a data folder re-prepared at the same path (a new tokenizer, more documents),
  or new blend weights, makes the same position mean other samples; the checkpoint records
  every source's identity (`data.source_fingerprint`: a prepared folder's manifest digest, else
  a checksum of a source's first and last MiB with its size; its weight and token and document
  counts), and a resume names the source that changed and how (`data_differences`); a
  checkpoint from before those records is compared by the checksum of the first sample it
  recorded. A run directory resuming its own checkpoint (``--resume auto``, or one of its own
  ``ckpt/`` named: what recover and supervise relaunch, a rollback included) refuses a change:
  that is a crash-restart, and it must train on what it trained on. The refusal
  (`check_data_unchanged`) comes before any line says the run resumed: the --local launcher
  makes it before a worker starts, the workers (under srun or torchrun) on the chosen
  checkpoint's manifest before loading it. ``--allow-data-change``, or a new run directory
  started from another run's checkpoint (``--resume OTHER/ckpt/step-N``), is the operator saying
  the change is meant: then it is one line and an event, and one more when there is a held-out
  split: it was re-cut and re-blended, so held-out losses before and after are not comparable.
- **the learning rate**: the schedule is a function of ``training.steps``; resuming with another
  ``--steps`` stretches or squeezes the cosine, so the rate jumps (a 20-step run extended to 40
  restarts from ~6× its last rate). Meant or not, the operator sees the jump before it trains.
"""

from __future__ import annotations

import math
import zlib
from dataclasses import dataclass
from typing import TYPE_CHECKING

from mscale.config.model import ModelConfig
from mscale.config.training import TrainingConfig
from mscale.errors import MscaleError
from mscale.train.schedule import learning_rate
from mscale.urls import location_key

if TYPE_CHECKING:  # numpy only, but only its type is needed here
    from mscale.data.blend import BlendedSamples


@dataclass(frozen=True)
class DataIdentity:
    """What a checkpoint records of its data, and a resumed run compares."""

    checksum: int
    """crc32 of sample 0 (``TrainState.data_fingerprint``, in every checkpoint)."""
    sources: list[dict] | None = None
    """One identity per source (`identities`; ``TrainState.data_sources``), None for synthetic
    data."""


def split_identity(train: BlendedSamples, held: BlendedSamples | None = None) -> DataIdentity:
    """The identity of token data from its splits (`blend.build_splits`), without torch: what
    the workers compute from their loader (train/data.py `source_fingerprint`) and the --local
    launcher from the splits it opened to check them, the same bytes."""
    return DataIdentity(zlib.crc32(train.sample(0).tobytes()), identities(train, held))


def check_data_unchanged(state, data: DataIdentity | None, checkpoint: str, own: bool,
                         data_change: bool = False) -> str | None:
    """How the data differ from what ``checkpoint`` (its TrainState ``state``) trained on, or
    None; MscaleError when that is a restart of the run's own checkpoint (``own``) without
    ``--allow-data-change``. Made before the checkpoint is loaded, and by the --local launcher
    before any worker starts, so no line has said the run resumed when it is refused."""
    what = data_differences(state, data, checkpoint)
    if what is not None and own and not data_change:
        raise MscaleError(what, field="training.data",
                          fix="restore the data that run trained on, or pass "
                              "--allow-data-change to go on with the new data on purpose")
    return what


def resume_notes(state, training: TrainingConfig, data: DataIdentity | None, own: bool,
                 checkpoint: str, data_change: bool = False) -> list[str]:
    """Lines to print for a resume from ``state`` (a manifest's TrainState); MscaleError when
    the data changed under a restart. ``data``: `data.source_fingerprint` of the data now (its
    ``sources`` compared with the checkpoint's ``data_sources`` when both have them, else the
    first sample's checksum); ``own``: the checkpoint is the run directory's own
    (`is_own`); ``data_change``: ``--allow-data-change`` (the change is meant)."""
    notes = []
    what = check_data_unchanged(state, data, checkpoint, own, data_change)
    if what is not None:
        notes.append(f"{what}: continuing at global sample {state.samples} of the new data, "
                     "so samples may repeat or be skipped (docs/data.md)")
        if training.data.kind == "tokens" and training.data.has_eval:
            notes.append(f"the held-out split was re-cut and re-blended with the data: held-out "
                         f"losses before step {state.step} and after it are not comparable "
                         "(docs/data.md)")
    if state.lr is not None and 0 < state.step < training.steps:  # past the end: nothing trains
        had = state.lr
        planned = learning_rate(training, state.step - 1)
        if not math.isclose(had, planned, rel_tol=1e-6, abs_tol=1e-12):
            notes.append(f"the learning rate jumps: step {state.step} trained at {had:.3g}, this "
                         f"run's schedule ({training.steps} steps) has {planned:.3g} there and "
                         f"{learning_rate(training, state.step):.3g} next (the schedule follows "
                         "training.steps; keep --steps to continue the same curve)")
    return notes


def data_differences(state, data: DataIdentity | None, checkpoint: str) -> str | None:
    """How the data now differ from what ``checkpoint`` (its TrainState ``state``) trained on,
    or None: per source when both sides record sources (a source re-prepared or changed, with
    its documents and tokens before -> after; a weight changed; a source added or removed),
    else by the first sample's checksum (checkpoints from before ``data_sources``)."""
    saved, now = getattr(state, "data_sources", None), data.sources if data else None
    if saved is not None and now is not None:
        changes = source_changes([_record(r) for r in saved], now)
        if not changes and state.data_fingerprint not in (None, data.checksum):
            changes = ["every source is as it was, but the first sample differs: the split, "
                       "the shuffle (seed) or seq_len changed, or a source's middle was "
                       "rewritten at the same size"]
        if not changes:
            return None
        shown = "; ".join(changes[:4]) + (f"; and {len(changes) - 4} more" if len(changes) > 4
                                          else "")
        return f"the training data differ from what {checkpoint} trained on: {shown}"
    old = state.data_fingerprint
    if old is None or data is None or old == data.checksum:
        return None
    return (f"the training data differ from what {checkpoint} trained on (first sample's "
            f"checksum {old}, now {data.checksum})")


def source_changes(saved: list[dict], now: list[dict]) -> list[str]:
    """What changed between two lists of source records (`data.identities`), one phrase each.
    Sources are matched by location (`location_key`), not spelling: ``./data/x``, ``data/x/``
    and its absolute path are one source (each side named as its run wrote it)."""
    before = {(r["role"], location_key(r["path"])): r for r in saved}
    after = {(r["role"], location_key(r["path"])): r for r in now}
    out = []
    for key, a in before.items():
        b = after.get(key)
        name = a["path"] + (" (held-out)" if a["role"] == "eval" else "")
        if b is None:
            out.append(f"{name} was removed (weight {a['weight']:g})")
            continue
        if (a["kind"], a["digest"]) != (b["kind"], b["digest"]):
            sizes = [f"{_count(a.get(k))} -> {_count(b.get(k))} {k}"
                     for k in ("documents", "tokens") if a.get(k) != b.get(k)]
            out.append(f"{name} was re-prepared or changed ("
                       + (", ".join(sizes) if sizes else "the same size, other contents") + ")")
        if a["weight"] != b["weight"]:
            out.append(f"{name}'s weight changed from {a['weight']:g} to {b['weight']:g}")
    out += [f"{b['path']}{' (held-out)' if b['role'] == 'eval' else ''} was added "
            f"(weight {b['weight']:g})" for key, b in after.items() if key not in before]
    return out


def identities(train: BlendedSamples, held: BlendedSamples | None = None) -> list[dict]:
    """One record per source, training sources first (``role`` train, their blend ``weight``),
    then held-out sources given apart (``role`` eval): ``path`` as the training file names it
    and `TokenDataset.identity` (a prepared folder's manifest digest; for other sources a
    checksum of their first and last MiB with their size)."""
    out, seen = [], set()
    for role, split in (("train", train), ("eval", held)):
        if split is None:
            continue
        for part, weight in zip(split.parts, split.weights):
            if id(part.dataset) in seen:  # the held-out end of a training source
                continue
            seen.add(id(part.dataset))
            out.append({"path": part.dataset.url, "role": role, "weight": float(weight),
                        **part.dataset.identity()})
    return out


def _record(r) -> dict:
    return r if isinstance(r, dict) else r.model_dump()


def _count(n) -> str:
    return "?" if n is None else f"{n:,}"


def is_own(checkpoint: str, ckpt_root: str) -> bool:
    """Whether ``checkpoint`` lies in the run directory's own ``ckpt/`` (`catalog.in_run`): a
    restart of this run, whether ``--resume auto`` found it or recover named it (a rollback)."""
    from mscale.ckpt.catalog import in_run

    return in_run(checkpoint, ckpt_root)


def model_note(saved: dict | None, model: ModelConfig, checkpoint: str) -> str | None:
    """A line when the plan's model differs from the one ``checkpoint`` was trained as (its
    manifest's ``plan.model``) in a field that does not change a tensor's shape (those fail the
    load): ``rope_theta`` for a context extension is meant, a changed ``norm_eps`` or
    ``real_vocab`` rarely is, and neither may pass unsaid. A run directory resuming its own
    checkpoint never gets here with another model: its plan check refuses that first."""
    if not isinstance(saved, dict):
        return None
    try:
        before = ModelConfig.model_validate(saved).model_dump(exclude={"name"})
    except ValueError:
        return None  # a manifest of another version: its loader already said what it could
    now = model.model_dump(exclude={"name"})
    changed = [f"{k} {before[k]!r} -> {now[k]!r}" for k in now if before.get(k) != now[k]]
    if not changed:
        return None
    return (f"the model differs from the one {checkpoint} trained: {'; '.join(changed)} "
            "(continuing with this plan's; if that is not meant, use the checkpoint's model: "
            "section)")

