"""Offline conversion: another layout, HF safetensors out, HF safetensors in.

All three are "write a checkpoint for every rank of a plan from some source of global tensors"
(`write_layout`): each target rank's slices are computed offline (ownership.for_plan, meta-device
modules) exactly as a live rank of that plan would write them, filled from the source, and
committed like a training save. One process; memory is one rank's slices at a time (plus, for an
HF import, the memory-mapped input).
"""

from __future__ import annotations

import contextlib
import json
import mmap
import os
from typing import Callable

import torch

from mscale.ckpt import catalog, hf, hf_config, safetensors
from mscale.ckpt.commit import build_manifest, write_commit
from mscale.ckpt.limits import DEFAULT_CHUNK_BYTES
from mscale.ckpt.load import CheckpointReader, has_optimizer
from mscale.ckpt.limits import MAX_LEVEL, MIN_LEVEL
from mscale.ckpt.manifest import MODEL, Manifest, TrainState, split_key, tensor_key
from mscale.ckpt.ownership import Item, for_plan, layout_record, meta_params, write_items
from mscale.ckpt.snapshot import Snapshot
from mscale.ckpt.writer import write_shard
from mscale.config.base import parse_json
from mscale.config.files import read_bytes as read_config_bytes
from mscale.config.plan import Plan
from mscale.topology.placement import load_checked_plan
from mscale.errors import EXIT_BAD_INPUT, MscaleError
from mscale.runs.atomic import fs_and_path, write_text_atomic
from mscale.runs.lock import holder_text, live_holder
from mscale.runs.rundir import RunDir
from mscale.runs.targets import check_output

Source = Callable[[Item], torch.Tensor]
"""The data of one slice (1-D, ``item.count`` elements)."""
MAX_HF_FILE = 5_000_000_000
"""Bytes per safetensors file before starting another (HF's default shard size)."""


def _check_empty(dst: str) -> None:
    fs, path = fs_and_path(dst)
    if fs.exists(path) and (not fs.isdir(path) or fs.ls(path)):
        raise MscaleError("destination exists and is not empty", file=dst,
                          fix="choose a new directory; conversion never overwrites")


def write_layout(dst: str, plan: Plan, source: Source, state: TrainState, *, optimizer: bool,
                 level: int = 1, chunk_bytes: int = DEFAULT_CHUNK_BYTES) -> Manifest:
    """Write and commit a checkpoint of ``plan``'s layout at ``dst``; ``latest`` is moved to it
    too when ``dst`` sits in a run's ``ckpt/`` directory and ``latest`` names no newer step."""
    codec = "zstd" if level else "raw"
    reports = []
    for rank in range(plan.layout.world_size):
        items = write_items(for_plan(plan, rank), optimizer=optimizer)
        views = [source(it).detach().contiguous().reshape(-1).view(torch.uint8) for it in items]
        snap = Snapshot(items, views, 0.0, sum(v.numel() for v in views))
        res = write_shard(dst, rank, snap, codec, level, chunk_bytes)
        reports.append({"shard": res.info,
                        "tensors": {it.key: [list(it.shape), it.dtype] for it in items}})
    manifest = build_manifest(state.step, reports, codec=codec, level=level,
                              chunk_bytes=chunk_bytes, layout=layout_record(plan),
                              plan=plan.model_dump(mode="json", exclude_none=True), state=state)
    write_commit(dst, manifest)
    if in_run(dst):  # never backwards: a run's newer checkpoints stay its latest
        catalog.advance_latest(catalog.parent(dst), catalog.basename(dst))
    return manifest


def in_run(dst: str) -> bool:
    """True when ``dst`` is ``RUN/ckpt/step-NNNNNN``, where ``latest`` may follow it."""
    return (catalog.basename(catalog.parent(dst)) == "ckpt"
            and catalog.STEP_DIR.match(catalog.basename(dst)) is not None)


def reshard(src: str, manifest: Manifest, dst: str, plan: Plan, level: int = 1) -> Manifest:
    """The checkpoint at another layout (model and optimizer state)."""
    with CheckpointReader(src, manifest) as reader:
        state = manifest.state.model_copy(update={"rng_world": None})
        return write_layout(dst, plan, reader.read_item, state,
                            optimizer=has_optimizer(manifest), level=level)


def _model_names(cfg) -> list[str]:
    """Global parameter names in the model's own order (embedding, blocks, norm, head)."""
    from types import SimpleNamespace

    plan = SimpleNamespace(layout=SimpleNamespace(tp=1, pp=1, sequence_parallel=False,
                                                  recompute="none"), model=cfg)
    return meta_params(plan, 0, 0)[1].names


def export_hf(src: str, manifest: Manifest, dst: str) -> dict:
    """A consolidated safetensors directory with LLaMA names and config.json."""
    from mscale.config.model import ModelConfig

    cfg = ModelConfig.model_validate(manifest.plan["model"])
    keys = {n: manifest.resolve(tensor_key(MODEL, n)) for n in _model_names(cfg)}
    names = [n for n, k in keys.items() if k in manifest.tensors]
    if not names:
        raise MscaleError("the checkpoint holds no model weights", file=src, field="tensors")
    files, cur, size = [], [], 0
    for n in names:
        info = manifest.tensors[keys[n]]
        nbytes = torch.empty((), dtype=_dtype(info.dtype)).element_size()
        for d in hf.hf_shape(n, info.shape, cfg):
            nbytes *= d
        if cur and size + nbytes > MAX_HF_FILE:
            files.append(cur)
            cur, size = [], 0
        cur.append(n)
        size += nbytes
    files.append(cur)
    fs, root = fs_and_path(dst)
    fs.makedirs(root, exist_ok=True)
    total, weight_map = 0, {}
    meta = {"format": "pt", "mscale_step": str(manifest.step)}
    with CheckpointReader(src, manifest) as reader:
        for i, group in enumerate(files):
            fname = ("model.safetensors" if len(files) == 1
                     else f"model-{i + 1:05d}-of-{len(files):05d}.safetensors")
            entries = [(hf.to_hf(n), _dtype(manifest.tensors[keys[n]].dtype),
                        hf.hf_shape(n, manifest.tensors[keys[n]].shape, cfg)) for n in group]
            back = {hf.to_hf(n): n for n in group}
            with fs.open(f"{root}/{fname}", "wb") as fh:
                total += safetensors.write(fh, entries, lambda h: hf.strip_vocab_rows(
                    back[h], reader.read_full(tensor_key(MODEL, back[h])), cfg), meta)
            weight_map.update({h: fname for h in back})
    if len(files) > 1:
        write_text_atomic(catalog.join(dst, "model.safetensors.index.json"), json.dumps(
            {"metadata": {"total_size": total}, "weight_map": weight_map}, indent=2))
    write_text_atomic(catalog.join(dst, "config.json"), hf.dumps_config(cfg))
    return {"format": "hf-safetensors", "tensors": len(names), "bytes": total, "files": len(files)}


def _dtype(name: str) -> torch.dtype:
    from mscale.ckpt.format import torch_dtype

    return torch_dtype(name)


def is_hf_dir(path: str) -> bool:
    fs, root = fs_and_path(path)
    return fs.isdir(root) and fs.exists(f"{root}/config.json") and any(
        p.endswith(".safetensors") for p in fs.ls(root, detail=False))


def open_hf(path: str) -> tuple[dict, dict[str, torch.Tensor]]:
    """config.json and every tensor of an HF directory (memory-mapped when local)."""
    fs, root = fs_and_path(path)
    config = read_hf_config(catalog.join(path, "config.json"))
    tensors: dict[str, torch.Tensor] = {}
    for p in sorted(fs.ls(root, detail=False)):
        if not p.endswith(".safetensors"):
            continue
        with fs.open(p, "rb") as fh:
            entries, _, start = safetensors.read_header(fh, p)
            if catalog.is_local(fs):
                mm = mmap.mmap(fh.fileno(), 0, access=mmap.ACCESS_COPY)
                for e in entries:
                    n = e.end - e.begin
                    t = (torch.frombuffer(mm, dtype=e.dtype, count=n // _size(e.dtype),
                                          offset=start + e.begin) if n else
                         torch.empty(0, dtype=e.dtype))
                    tensors[e.name] = t.view(e.shape)
            else:
                tensors.update({e.name: safetensors.read_tensor(fh, e, start) for e in entries})
    return config, tensors


def read_hf_config(url: str) -> object:
    """config.json of an HF directory as JSON data: read bounded and without blocking (a FIFO, a
    directory), UTF-8 only (json would silently accept UTF-16), depth and numbers bounded; every
    failure names the file (exit 3)."""
    data = read_config_bytes(url)
    return parse_json(data, url, what="config.json", code=EXIT_BAD_INPUT,
                      fix="give the config.json of an HF model directory, as UTF-8 JSON")


def _size(dtype: torch.dtype) -> int:
    return torch.empty((), dtype=dtype).element_size()


def import_hf(src: str, dst: str, plan: Plan, level: int = 1) -> Manifest:
    """A model-only checkpoint (step 0, fresh optimizer) of ``plan``'s layout from HF weights."""
    config, tensors = open_hf(src)
    source_file = f"{src}/config.json"
    cfg = hf.fit_to_plan(hf_config.model_from_hf_config(config, source_file), plan.model,
                         plan.layout.tp, source_file)
    plan = plan.model_copy(update={"model": cfg})  # the checkpoint records real_vocab
    by_name = {}
    for h, t in tensors.items():
        try:
            by_name[hf.from_hf(h, cfg)] = t
        except KeyError:
            raise MscaleError(f"unexpected tensor {h}", file=src, field="tensors",
                              fix="export only the LLaMA tensors listed in docs/ckpt.md")

    def source(it: Item) -> torch.Tensor:
        name = split_key(it.key)[1]
        if name not in by_name:
            raise MscaleError(f"{hf.to_hf(name)} is missing", file=src, field="tensors",
                              fix="the HF directory must hold every weight of the model")
        full = by_name[name]
        need = hf.hf_shape(name, it.shape, cfg)
        if tuple(full.shape) != need:
            raise MscaleError(f"{hf.to_hf(name)} has shape {list(full.shape)}, the model needs "
                              f"{list(need)}", file=src, field="tensors")
        region = hf.padded_region(name, full, it.box, cfg).to(torch.float32)
        return region.reshape(-1)[it.flat[0]: it.flat[1]]

    state = TrainState(step=0, samples=0)
    return write_layout(dst, plan, source, state, optimizer=False, level=level)


def convert(src: str, dst: str, plan: str | None = None, to_hf: bool = False,
            level: int = 1) -> dict:
    """The CLI's entry point; returns a JSON-able summary. Everything that can be checked is
    checked before any byte is written (level, destination, source, plan, step); a conversion
    that fails later removes the directory it created."""
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
        m = _cleanup_on_error(dst, lambda: import_hf(src, dst, target, level))
        return _summary(src, dst, "mscale, model only, from HF", m)
    ckpt = catalog.resolve(src)
    manifest = catalog.load_committed(ckpt)
    if to_hf:
        return {"src": ckpt, "dst": dst,
                **_cleanup_on_error(dst, lambda: export_hf(ckpt, manifest, dst))}
    target = load_checked_plan(plan)
    _check_same_model(manifest, target, plan)
    _check_step_name(dst, manifest.step)
    m = _cleanup_on_error(dst, lambda: reshard(ckpt, manifest, dst, target, level))
    return _summary(ckpt, dst, "mscale", m)


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
            raise MscaleError(
                f"{d} is in use by a running job ({holder_text(rec)}): ckpt convert does not "
                f"write into a live run; stop the job first (touch {halt}) or write "
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
    out = {"src": src, "dst": dst, "format": fmt, "tensors": len(m.tensors),
           "bytes": sum(s.bytes for s in m.shards), "layout": m.layout, "step": m.step}
    if in_run(dst):
        root = catalog.parent(dst)
        out["latest"] = catalog.read_latest(root)
        if out["latest"] != catalog.basename(dst):
            out["note"] = (f"{catalog.join(root, catalog.LATEST)} still names {out['latest']}, "
                           f"newer than step {m.step}: resume from this checkpoint with "
                           f"--resume {dst}")
    return out
