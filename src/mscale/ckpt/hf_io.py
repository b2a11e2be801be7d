"""HuggingFace safetensors out of a checkpoint (`export_hf`) and into one (`import_hf`).

An export reads each global tensor whole (one at a time) and streams it into consolidated
safetensors files under LLaMA names, split at `MAX_HF_FILE` bytes as HF splits them. An import
memory-maps the HF files (when local) and writes a model-only checkpoint of a plan's layout
through rewrite.write_layout. Both take ``progress``/``on_start`` (ckpt/progress.py).
"""

from __future__ import annotations

import json
import mmap

import torch

from mscale.ckpt import catalog, hf, hf_config, safetensors
from mscale.ckpt.hf_files import INDEX, check_mapped, hf_files
from mscale.ckpt.load import CheckpointReader
from mscale.ckpt.manifest import MODEL, Manifest, TrainState, split_key, tensor_key
from mscale.ckpt.ownership import Item, meta_params
from mscale.ckpt.progress import OnStart, Progress, Tally
from mscale.ckpt.rewrite import write_layout
from mscale.config.json_reader import parse_json
from mscale.config.files import read_bytes as read_config_bytes
from mscale.config.plan import Plan
from mscale.errors import EXIT_BAD_INPUT, MscaleError
from mscale.runs.atomic import fs_and_path, write_text_atomic

MAX_HF_FILE = 5_000_000_000
"""Bytes per safetensors file before starting another (HF's default shard size)."""


def _model_table(cfg):
    """The model's parameters at tp 1, pp 1 (global names and shapes), in its own order
    (embedding, blocks, norm, head)."""
    from types import SimpleNamespace

    plan = SimpleNamespace(layout=SimpleNamespace(tp=1, pp=1, sequence_parallel=False,
                                                  recompute="none"), model=cfg)
    return meta_params(plan, 0, 0)[1]


def _model_names(cfg) -> list[str]:
    """Global parameter names in the model's own order (embedding, blocks, norm, head)."""
    return _model_table(cfg).names


def _check_weights(by_name: dict[str, torch.Tensor], cfg, src: str) -> None:
    """Every weight the model needs is there at its shape, checked from the headers before the
    start line and the first byte written: found during the write, a missing one failed a
    conversion already announced and under way (at 70B, after minutes of writing)."""
    missing, wrong = [], []
    for spec in _model_table(cfg):
        if spec.name not in by_name:
            missing.append(hf.to_hf(spec.name))
            continue
        need = hf.hf_shape(spec.name, spec.global_shape, cfg)
        if tuple(by_name[spec.name].shape) != need:
            wrong.append(f"{hf.to_hf(spec.name)} has shape {list(by_name[spec.name].shape)}, "
                         f"the model needs {list(need)}")
    if missing:
        shown = ", ".join(missing[:5]) + (f" and {len(missing) - 5} more" if len(missing) > 5
                                          else "")
        raise MscaleError(f"{shown} {'is' if len(missing) == 1 else 'are'} missing", file=src,
                          field="tensors", code=EXIT_BAD_INPUT,
                          fix="the HF directory must hold every weight of the model (a sharded "
                              "one: every model-0000N-of-0000M.safetensors)")
    if wrong:
        raise MscaleError("; ".join(wrong[:5]), file=src, field="tensors", code=EXIT_BAD_INPUT,
                          fix="use the HF weights of the model config.json describes")


def _hf_sizes(src: str, manifest: Manifest, cfg) -> dict[str, int]:
    """The bytes of each model weight in HF form (vocabulary padding stripped), model order."""
    keys = {n: manifest.resolve(tensor_key(MODEL, n)) for n in _model_names(cfg)}
    sizes = {}
    for n, k in keys.items():
        if k not in manifest.tensors:
            continue
        info = manifest.tensors[k]
        sizes[n] = _size(_dtype(info.dtype))
        for d in hf.hf_shape(n, info.shape, cfg):
            sizes[n] *= d
    if not sizes:
        raise MscaleError("the checkpoint holds no model weights", file=src, field="tensors")
    return sizes


def _files(sizes: dict[str, int]) -> list[list[str]]:
    """The weights split into files of at most `MAX_HF_FILE` bytes (a larger weight alone)."""
    files, cur, size = [], [], 0
    for n, nbytes in sizes.items():
        if cur and size + nbytes > MAX_HF_FILE:
            files.append(cur)
            cur, size = [], 0
        cur.append(n)
        size += nbytes
    files.append(cur)
    return files


def export_hf(src: str, manifest: Manifest, dst: str, progress: Progress | None = None,
              on_start: OnStart | None = None) -> dict:
    """A consolidated safetensors directory with LLaMA names and config.json; ``progress``
    counts the tensor bytes written (headers aside)."""
    from mscale.config.model import ModelConfig

    cfg = ModelConfig.model_validate(manifest.plan["model"])
    sizes = _hf_sizes(src, manifest, cfg)
    files = _files(sizes)
    tally = Tally(sum(sizes.values()), progress)
    if on_start is not None:
        on_start({"tensors": len(sizes), "bytes": tally.total, "files": len(files)})
    fs, root = fs_and_path(dst)
    fs.makedirs(root, exist_ok=True)
    total, weight_map = 0, {}
    with CheckpointReader(src, manifest) as reader:
        for i, group in enumerate(files):
            fname = ("model.safetensors" if len(files) == 1
                     else f"model-{i + 1:05d}-of-{len(files):05d}.safetensors")
            with fs.open(f"{root}/{fname}", "wb") as fh:
                total += _write_file(fh, group, reader, cfg, tally)
            weight_map.update({hf.to_hf(n): fname for n in group})
    if len(files) > 1:
        write_text_atomic(catalog.join(dst, "model.safetensors.index.json"), json.dumps(
            {"metadata": {"total_size": total}, "weight_map": weight_map}, indent=2))
    write_text_atomic(catalog.join(dst, "config.json"), hf.dumps_config(cfg))
    return {"format": "hf-safetensors", "tensors": len(sizes), "bytes": total, "files": len(files)}


def _write_file(fh, group: list[str], reader: CheckpointReader, cfg, tally: Tally) -> int:
    """One safetensors file of the weights ``group``, each read whole only as it is reached."""
    manifest = reader.manifest
    infos = {n: manifest.tensors[manifest.resolve(tensor_key(MODEL, n))] for n in group}
    entries = [(hf.to_hf(n), _dtype(infos[n].dtype), hf.hf_shape(n, infos[n].shape, cfg))
               for n in group]
    back = {hf.to_hf(n): n for n in group}
    meta = {"format": "pt", "mscale_step": str(manifest.step)}
    return safetensors.write(fh, entries, lambda h: hf.strip_vocab_rows(
        back[h], reader.read_full(tensor_key(MODEL, back[h])), cfg), meta, after=tally.add)


def _dtype(name: str) -> torch.dtype:
    from mscale.ckpt.format import torch_dtype

    return torch_dtype(name)


def is_hf_dir(path: str) -> bool:
    fs, root = fs_and_path(path)
    return fs.isdir(root) and fs.exists(f"{root}/config.json") and any(
        p.endswith((".safetensors", f"/{INDEX}")) for p in fs.ls(root, detail=False))


def open_hf(path: str) -> tuple[dict, dict[str, torch.Tensor]]:
    """config.json and the tensors of an HF directory (memory-mapped when local): those its
    model.safetensors.index.json maps, each from its file, or without one every tensor of
    every ``*.safetensors`` (`hf_files`)."""
    fs, _ = fs_and_path(path)
    config = read_hf_config(catalog.join(path, "config.json"))
    chosen = hf_files(path)
    tensors: dict[str, torch.Tensor] = {}
    held: dict[str, str] = {}  # tensor name -> the file it came from
    for url in chosen.files:
        p = fs_and_path(url)[1]
        with fs.open(p, "rb") as fh:
            entries, _, start = safetensors.read_header(fh, url)
            entries = check_mapped(entries, url, chosen.weight_map)
            _refuse_twice_held(entries, url, held)
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


def _refuse_twice_held(entries, path: str, held: dict[str, str]) -> None:
    """Without an index every ``*.safetensors`` of the folder is read, so a tensor in two of
    them (a stale shard of an earlier export, a copy kept aside) would be taken from whichever
    sorts last, silently: refuse it, naming both files. (An index maps each tensor to one
    file: `hf_files.check_mapped` reads it from there alone.)"""
    for e in entries:
        if e.name in held:
            raise MscaleError(
                f"also in {catalog.basename(held[e.name])}: two files of the "
                "folder hold it, and which one the weights come from would be a guess",
                file=path, field=e.name, code=EXIT_BAD_INPUT,
                fix="remove or move away the file that is not part of the model (without "
                    f"a {INDEX}, every *.safetensors in the folder is read)")
        held[e.name] = path


def read_hf_config(url: str) -> object:
    """config.json of an HF directory as JSON data: read bounded and without blocking (a FIFO, a
    directory), UTF-8 only (json would silently accept UTF-16), depth and numbers bounded; every
    failure names the file (exit 3)."""
    data = read_config_bytes(url)
    return parse_json(data, url, what="config.json", code=EXIT_BAD_INPUT,
                      fix="give the config.json of an HF model directory, as UTF-8 JSON")


def _size(dtype: torch.dtype) -> int:
    return torch.empty((), dtype=dtype).element_size()


def import_hf(src: str, dst: str, plan: Plan, level: int = 1, progress: Progress | None = None,
              on_start: OnStart | None = None) -> Manifest:
    """A model-only checkpoint (step 0, fresh optimizer) of ``plan``'s layout from HF weights;
    ``progress`` counts the bytes of the checkpoint written (rewrite.write_layout)."""
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

    _check_weights(by_name, cfg, src)
    state = TrainState(step=0, samples=0)
    return write_layout(dst, plan, source, state, optimizer=False, level=level,
                        progress=progress, on_start=on_start)
