"""Offline conversion, `mscale ckpt convert`: another layout, HF safetensors out, HF safetensors in.

All three are "write a checkpoint for every rank of a plan from some source of global tensors"
(rewrite.py) or, for an export, stream whole tensors into safetensors files (hf_io.py). This
module is the entry point: everything that can be checked is checked here before any byte is
written, and a failed conversion removes what it wrote. Progress goes to the caller's callables
(ckpt/progress.py), never to a console.
"""

from __future__ import annotations

import contextlib
import os
import shlex
from typing import Callable

from mscale.ckpt import catalog
from mscale.ckpt.hf_files import hf_files
from mscale.ckpt.hf_io import export_hf, import_hf, is_hf_dir, open_hf, read_hf_config
from mscale.ckpt.limits import MAX_LEVEL, MIN_LEVEL
from mscale.ckpt.manifest import Manifest
from mscale.ckpt.progress import OnStart, Progress, announce
from mscale.ckpt.rewrite import in_run, reshard, write_layout
from mscale.config.plan import Plan
from mscale.topology.placement import load_checked_plan
from mscale.errors import EXIT_BAD_INPUT, MscaleError
from mscale.runs.atomic import fs_and_path
from mscale.runs.lock import holder_text, live_holder
from mscale.runs.rundir import RunDir
from mscale.runs.targets import check_output

__all__ = ["convert", "check_level", "check_not_live", "export_hf", "import_hf", "in_run",
           "is_hf_dir", "open_hf", "read_hf_config", "reshard", "write_layout"]
"""The conversion API, wherever each piece lives."""


def _check_empty(dst: str) -> None:
    fs, path = fs_and_path(dst)
    if fs.exists(path) and (not fs.isdir(path) or fs.ls(path)):
        raise MscaleError("destination exists and is not empty", file=dst,
                          fix="choose a new directory; conversion never overwrites")


def convert(src: str, dst: str, plan: str | None = None, to_hf: bool = False, level: int = 1,
            progress: Progress | None = None, on_start: OnStart | None = None) -> dict:
    """The CLI's entry point; returns a JSON-able summary. Everything that can be checked is
    checked before any byte is written (level, destination, source, plan, step); a conversion
    that fails later removes the directory it created. ``on_start`` is told the source (resolved
    to its checkpoint), destination, format, tensors and bytes once all checks passed;
    ``progress`` the bytes written (ckpt/progress.py)."""
    check_level(level)
    check_output(dst, "dir", "DEST")
    check_not_live(dst)
    _check_empty(dst)
    if is_hf_dir(src):
        if to_hf or not plan:
            raise MscaleError("the source is already an HF directory", file=src, field="--plan",
                              fix="pass --plan PLAN to import it as an mscale checkpoint")
        target = load_checked_plan(plan)
        _check_step_name(dst, 0)
        fmt = "mscale, model only, from HF"
        not_read = hf_files(src).not_read  # a file the index lists but lacks: refused here
        told = announce(on_start, src=src, dst=dst, format=fmt, not_read=not_read)
        m = _cleanup_on_error(dst, lambda: import_hf(src, dst, target, level, progress, told))
        return {**_summary(src, dst, fmt, m), **({"not_read": not_read} if not_read else {})}
    try:
        ckpt = catalog.resolve(src)
    except MscaleError:
        _refuse_hf_without_safetensors(src)
        raise
    manifest = catalog.load_named(ckpt)
    if to_hf:
        told = announce(on_start, src=ckpt, dst=dst, format="hf-safetensors")
        return {"src": ckpt, "dst": dst, **_cleanup_on_error(
            dst, lambda: export_hf(ckpt, manifest, dst, progress, told))}
    target = load_checked_plan(plan)
    _check_same_model(manifest, target, plan)
    _check_step_name(dst, manifest.step)
    told = announce(on_start, src=ckpt, dst=dst, format="mscale")
    m = _cleanup_on_error(dst, lambda: reshard(ckpt, manifest, dst, target, level, progress, told))
    return _summary(ckpt, dst, "mscale", m)


def _refuse_hf_without_safetensors(src: str) -> None:
    """An HF folder without ``*.safetensors`` (``pytorch_model.bin``, or weights not yet
    copied) is no HF source to `is_hf_dir`, and `catalog.resolve`'s refusal says "convert it
    first: mscale ckpt convert SRC DST --plan PLAN": the very command that was just run."""
    fs, root = fs_and_path(src)
    if not (fs.isdir(root) and fs.exists(f"{root}/config.json")):
        return
    names = sorted(catalog.basename(p) for p in fs.ls(root, detail=False))
    pickled = [n for n in names if n.endswith((".bin", ".pt", ".pth", ".ckpt"))]
    what = (f"its weights are pickled PyTorch files ({', '.join(pickled[:3])}), which mscale "
            "never unpickles" if pickled else "it holds no *.safetensors file")
    raise MscaleError(f"an HF model folder, but {what}", file=src,
                      fix="save the weights as safetensors (transformers: "
                          "model.save_pretrained(DIR, safe_serialization=True)) beside "
                          "config.json, then convert that folder")


def _ancestors(dst: str) -> list[str]:
    """The directories above ``dst``, nearest first (a local path made absolute; a URL's up to
    its bucket or root)."""
    if "://" not in dst:
        out, d = [], os.path.dirname(os.path.abspath(dst))
        while True:
            out.append(d)
            up = os.path.dirname(d)
            if up == d:
                return out
            d = up
    scheme, rest = dst.split("://", 1)
    parts = [p for p in rest.split("/") if p]
    return [f"{scheme}://" + "/".join(parts[:i]) for i in range(len(parts) - 1, 0, -1)]


def _shown(d: str, dst: str) -> str:
    """``d`` as the user would write it: relative when DEST was given relative."""
    if "://" in dst or os.path.isabs(dst):
        return d
    rel = os.path.relpath(d)
    return d if rel.startswith("..") else rel


def check_not_live(dst: str) -> None:
    """Refuse a DEST inside a run directory whose lock a live job holds (`runs.lock`'s rule):
    that job's ``ckpt/latest`` would move to weights it never trained, its retention could
    delete them, and its next resume would load them. One line, exit 3. A ``lock.json`` that is
    not a lock record (another tool's) says nothing about a run and is passed over."""
    for d in _ancestors(dst):
        fs, path = fs_and_path(RunDir(d).lock)
        if not fs.isfile(path):
            continue
        try:
            rec = live_holder(d)
        except (MscaleError, OSError):  # not a run's lock (another tool's, or unreadable)
            continue
        if rec is not None:
            d = _shown(d, dst)
            halt = RunDir(d).path("control", "halt")
            raise MscaleError(  # halt quoted: the touch is for pasting into a shell
                f"{d} is in use by a running job ({holder_text(rec)}): ckpt convert does not "
                f"write into a live run; stop the job first (touch {shlex.quote(halt)}) or "
                "write "
                f"{catalog.basename(dst)} outside {d}", code=EXIT_BAD_INPUT)


def check_level(level: int) -> None:
    """The zstd levels mscale writes (0: raw chunks); zstd itself refuses above 22."""
    if not MIN_LEVEL <= level <= MAX_LEVEL:
        raise MscaleError(f"zstd level {level} is outside {MIN_LEVEL}..{MAX_LEVEL}",
                          field="--zstd-level", fix="use 1 (fast, the default) to 19 (small); "
                                                    "0 stores chunks uncompressed")


def _check_same_model(manifest: Manifest, target: Plan, plan_file: str) -> None:
    """Resharding moves a model to another layout, never to another model: a plan whose model
    differs would read tensors that do not exist, or silently drop some."""
    saved = type(target.model).model_validate(manifest.plan["model"]).model_dump(mode="json")
    mine = target.model.model_dump(mode="json")
    diffs = sorted(k for k in (set(saved) | set(mine)) - {"name"} if saved.get(k) != mine.get(k))
    if diffs:
        detail = "; ".join(f"{k}: {saved.get(k)!r} in the checkpoint, {mine.get(k)!r} in the "
                           "plan" for k in diffs)
        raise MscaleError(f"the plan's model differs from the checkpoint's ({detail})",
                          file=plan_file, field=", ".join(f"model.{k}" for k in diffs),
                          fix="use a plan whose model: section is the checkpoint's (only the "
                              "layout may change)")


def _check_step_name(dst: str, step: int) -> None:
    """A ``step-NNNNNN`` directory holds step NNNNNN: `ls`, retention and ``latest`` go by the
    name, resuming by the manifest, so the two must never disagree."""
    m = catalog.STEP_DIR.match(catalog.basename(dst))
    if m and int(m.group(1)) != step:
        right = catalog.join(catalog.parent(dst), catalog.step_dir(step))
        raise MscaleError(f"{catalog.basename(dst)} names step {int(m.group(1))}, but the "
                          f"checkpoint written there is at step {step}", file=dst, field="DEST",
                          fix=f"write it to {right}, or to a directory not named step-NNNNNN")


def _cleanup_on_error(dst: str, work: Callable):
    """Run ``work``; if it fails, remove ``dst`` (it did not exist before: `_check_empty`)."""
    fs, path = fs_and_path(dst)
    existed = fs.exists(path)
    try:
        return work()
    except BaseException:
        if not existed:
            with contextlib.suppress(Exception):
                catalog.remove(dst)
        raise


def _summary(src: str, dst: str, fmt: str, m: Manifest) -> dict:
    """What a conversion to an mscale checkpoint wrote; ``bytes`` its size on disk, as
    ``ckpt ls`` and ``ckpt verify`` print it (`catalog.dir_bytes`)."""
    out = {"src": src, "dst": dst, "format": fmt, "tensors": len(m.tensors),
           "bytes": catalog.dir_bytes(dst), "layout": m.layout, "step": m.step}
    if in_run(dst):
        root = catalog.parent(dst)
        out["latest"] = catalog.read_latest(root)
        if out["latest"] != catalog.basename(dst):
            out["note"] = (f"{catalog.join(root, catalog.LATEST)} still names {out['latest']}, "
                           f"newer than step {m.step}: resume from this checkpoint with "
                           f"--resume {shlex.quote(dst)}")  # copied into a shell
    return out
