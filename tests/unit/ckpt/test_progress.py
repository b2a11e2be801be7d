"""Progress of the long offline jobs (ckpt/progress.py): each convert path (another layout, HF
out, HF in) and verify tell ``on_start`` the tensors and bytes before the first byte, then
``progress(done, total)`` with ``done`` never going back and ending at exactly that total. The
totals are checked against what was written, counted independently (the manifest's slices, the
safetensors tensors)."""

from __future__ import annotations

import os

import pytest

from mscale.ckpt import catalog, files
from mscale.ckpt.convert import convert, open_hf, reshard
from mscale.ckpt.manifest import itemsize
from mscale.ckpt.progress import Tally
from mscale.ckpt.verify import verify
from mscale.config.base import dump_yaml
from tests.unit.ckpt.helpers import global_state, plan, write_synthetic


class Seen:
    """An ``on_start`` and a ``progress`` that record their calls."""

    def __init__(self) -> None:
        self.starts: list[dict] = []
        self.calls: list[tuple[int, int]] = []

    def on_start(self, info: dict) -> None:
        assert not self.calls, "on_start comes before any progress"
        self.starts.append(info)

    def progress(self, done: int, total: int) -> None:
        self.calls.append((done, total))

    def check(self, total: int, key: str = "bytes") -> None:
        """One start telling ``total`` as ``key``; progress monotonic, one total throughout,
        ending at ``total``."""
        assert len(self.starts) == 1 and self.starts[0][key] == total
        done = [d for d, _ in self.calls]
        assert len(done) > 1 and done == sorted(done) and done[-1] == total
        assert {t for _, t in self.calls} == {total}


def _raw_bytes(path: str) -> int:
    """The uncompressed bytes of every slice the manifest records."""
    m = catalog.load_committed(path)
    return sum((s.flat[1] - s.flat[0]) * itemsize(m.tensors[s.tensor].dtype)
               for shard in m.shards for s in files.shard_slices(path, m, shard))


@pytest.fixture(scope="module")
def src(tmp_path_factory):
    """A model-and-optimizer checkpoint at tp2 dp2, small 1 KiB chunks (many per slice)."""
    p = plan(tp=2, dp=2)
    path = str(tmp_path_factory.mktemp("src") / "ckpt" / "step-000005")
    write_synthetic(path, p, global_state(p))
    return path


@pytest.fixture(scope="module")
def model_only(tmp_path_factory):
    p = plan(tp=2)
    path = str(tmp_path_factory.mktemp("model") / "ckpt" / "step-000005")
    write_synthetic(path, p, global_state(p, optimizer=False))
    return path


def test_reshard_reports_every_byte_it_writes(src, tmp_path):
    seen, target = Seen(), plan(tp=1, pp=2, dp=2)
    dst = str(tmp_path / "out")
    m = reshard(src, catalog.load_committed(src), dst, target, progress=seen.progress,
                on_start=seen.on_start)
    seen.check(_raw_bytes(dst))
    info = seen.starts[0]
    assert info["tensors"] == len(m.tensors) and info["ranks"] == 4
    assert info["layout"] == m.layout
    slices = sum(len(files.shard_slices(dst, m, s)) for s in m.shards)
    assert len(seen.calls) >= slices  # a call per slice


def test_convert_adds_source_destination_and_format(src, tmp_path):
    plan_file = tmp_path / "plan.yaml"
    plan_file.write_text(dump_yaml(plan(tp=4, dp=1)))
    seen, dst = Seen(), str(tmp_path / "out")
    out = convert(os.path.dirname(src), dst, plan=str(plan_file), progress=seen.progress,
                  on_start=seen.on_start)
    seen.check(_raw_bytes(dst))
    info = seen.starts[0]
    assert (info["src"], info["dst"], info["format"]) == (src, dst, "mscale")
    assert info["tensors"] == out["tensors"]


def test_export_to_hf_reports_the_tensor_bytes(model_only, tmp_path):
    seen, dst = Seen(), str(tmp_path / "hf")
    out = convert(model_only, dst, to_hf=True, progress=seen.progress, on_start=seen.on_start)
    _, tensors = open_hf(dst)
    seen.check(sum(t.numel() * t.element_size() for t in tensors.values()))
    info = seen.starts[0]
    assert info["format"] == "hf-safetensors" and info["files"] == out["files"] == 1
    assert info["tensors"] == out["tensors"] == len(tensors) == len(seen.calls)


def test_import_from_hf_reports_every_byte_it_writes(model_only, tmp_path):
    hf_dir = str(tmp_path / "hf")
    convert(model_only, hf_dir, to_hf=True)
    plan_file = tmp_path / "plan.yaml"
    plan_file.write_text(dump_yaml(plan(tp=2, pp=2)))
    seen, dst = Seen(), str(tmp_path / "run" / "ckpt" / "step-000000")
    out = convert(hf_dir, dst, plan=str(plan_file), progress=seen.progress,
                  on_start=seen.on_start)
    seen.check(_raw_bytes(dst))
    info = seen.starts[0]
    assert info["format"] == "mscale, model only, from HF" and info["src"] == hf_dir
    assert info["tensors"] == out["tensors"] and info["ranks"] == 4


@pytest.mark.parametrize("quick", [False, True])
def test_verify_reports_the_shard_bytes_it_checks(src, quick):
    seen = Seen()
    rep = verify(src, quick=quick, progress=seen.progress, on_start=seen.on_start)
    assert rep.ok
    seen.check(rep.shard_bytes, "shard_bytes")
    info = seen.starts[0]
    assert (info["path"], info["step"], info["shards"], info["quick"]) == (src, 5, 4, quick)
    per_shard = len(catalog.load_committed(src).shards)
    assert (len(seen.calls) == per_shard) if quick else (len(seen.calls) > per_shard)


def test_verify_counts_a_missing_or_short_shard_whole(src, tmp_path):
    import shutil

    bad = tmp_path / "bad"
    shutil.copytree(src, bad)
    (bad / "rank-00001.bin").unlink()
    with open(bad / "rank-00002.bin", "r+b") as fh:
        fh.truncate(10)
    seen = Seen()
    rep = verify(str(bad), progress=seen.progress, on_start=seen.on_start)
    assert {p.file for p in rep.problems} == {"rank-00001.bin", "rank-00002.bin"}
    seen.check(rep.shard_bytes, "shard_bytes")


def test_a_manifest_that_does_not_parse_starts_nothing(src, tmp_path):
    import shutil

    bad = tmp_path / "bad"
    shutil.copytree(src, bad)
    (bad / "manifest.json").write_text("{")
    seen = Seen()
    assert not verify(str(bad), progress=seen.progress, on_start=seen.on_start).ok
    assert seen.starts == [] and seen.calls == []


def test_tally_never_goes_back_nor_past_its_total():
    calls = []
    t = Tally(100, lambda d, n: calls.append(d))
    t.add(30)
    t.to(20)  # back: stays
    t.add(500)  # past the total: stops there
    assert calls == [30, 30, 100] and t.done == 100
    Tally(5).add(3)  # without a progress: nothing to call
