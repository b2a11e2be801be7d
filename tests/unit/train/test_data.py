import os

import numpy as np
import pytest

from mscale.config.training import DataConfig
from mscale.errors import MscaleError
import torch

from mscale.data.indexed import IndexedWriter
from tests.unit.data.folders import prepared
from mscale.train.data import (BatchPlan, DataLoader, DatasetTokens, ReadAhead, SyntheticTokens,
                               make_source, make_sources)


def test_batch_plan_covers_global_batch_once_at_any_layout():
    for dp, mb in ((1, 16), (2, 2), (4, 1), (8, 2)):
        seen = []
        for d in range(dp):
            plan = BatchPlan(global_batch=16, micro_batch=mb, dp_size=dp, dp_rank=d)
            for j in range(plan.micro_batches):
                seen += plan.indices_from(3 * 16, micro=j)
        assert sorted(seen) == list(range(48, 64))


def test_synthetic_is_deterministic_and_learnable():
    a, b = SyntheticTokens(7, 32, 100), SyntheticTokens(7, 32, 100)
    assert (a.sample(5) == b.sample(5)).all()
    assert not (a.sample(5) == a.sample(6)).all()
    s = a.sample(11)
    follows = (a.successor[s[:-1]] == s[1:]).float().mean()
    assert follows > 0.7  # mostly a fixed successor: there is something to learn


def test_a_flat_token_file_in_file_order_samples_and_wraps(tmp_path):
    path = tmp_path / "tok.bin"
    np.arange(1000, dtype=np.uint16).tofile(path)
    src = make_source(DataConfig(kind="tokens", path=str(path), dtype="uint16", shuffle=False),
                      0, 10, 2000)
    assert isinstance(src, DatasetTokens) and src.samples.mixture.counts.tolist() == [99]
    assert src.sample(2).tolist() == list(range(20, 31))
    assert src.sample(99).tolist() == src.sample(0).tolist()  # epoch 2 starts over
    loader = DataLoader(src, BatchPlan(4, 2, 1, 0))
    x, y = loader.get(step=0, micro=1)
    assert x.shape == (2, 10) and (y[:, :-1] == x[:, 1:]).all()


def test_token_file_errors_name_field(tmp_path):
    with pytest.raises(MscaleError) as e:
        make_source(DataConfig(path=str(tmp_path / "missing.bin")), 0, 8, 100)
    assert e.value.field == "training.data.path" or "training.data.path" in str(e.value)
    path = tmp_path / "big.bin"
    np.full(100, 500, dtype=np.uint16).tofile(path)
    with pytest.raises(MscaleError, match="vocab"):
        make_source(DataConfig(path=str(path)), 0, 8, 100)


def test_a_blends_dtype_speaks_for_its_flat_files_only(tmp_path):
    """A uint32 flat file blended with a uint16 prepared folder: data.dtype uint32 reads the
    flat file right and makes no claim about the folder. (The folder's error used to say "drop
    the dtype option", which made the flat file read as uint16: every other token 0.)"""
    prepared(tmp_path / "p", [[5, 6, 7, 8] * 10] * 4)
    np.arange(70000, 70000 + 2000, dtype=np.uint32).tofile(tmp_path / "big.bin")
    cfg = DataConfig(sources=[{"path": str(tmp_path / "p")}, {"path": str(tmp_path / "big.bin")}],
                     dtype="uint32", shuffle=False)
    src = make_source(cfg, 0, 10, 80000)
    flat = [p.dataset for p in src.samples.parts if p.dataset.url.endswith("big.bin")][0]
    assert flat.shards[0].dtype == np.uint32 and flat.num_tokens == 2000
    with pytest.raises(MscaleError, match="dtype given is uint32"):  # one source, stated: checked
        from mscale.data.datasets import open_dataset
        open_dataset(str(tmp_path / "p"), dtype="uint32")


def _blend(tmp_path) -> DataConfig:
    rng = np.random.default_rng(0)
    with IndexedWriter(str(tmp_path / "a"), np.uint16) as w:
        for _ in range(50):
            w.add_document(rng.integers(0, 100, int(rng.integers(5, 40))))
    rng.integers(100, 200, 3000).astype(np.uint16).tofile(tmp_path / "b.bin")
    return DataConfig(sources=[{"path": str(tmp_path / "a"), "weight": 2.0},
                               {"path": str(tmp_path / "b.bin")}], eval_fraction=0.2)


def test_a_blend_is_shuffled_weighted_and_its_held_out_part_never_trained_on(tmp_path):
    train, held = make_sources(_blend(tmp_path), 3, 8, 256)
    batch = train.batch(list(range(3000)))
    from_a = (batch < 100).all(dim=1).float().mean().item()  # source a's tokens are < 100
    assert abs(from_a - 2 / 3) < 0.02
    starts = [int(train.samples.mixture.locate(np.array([k]))[1][0]) for k in range(20)]
    assert starts != sorted(starts)  # shuffled
    seen = {tuple(r) for r in batch.tolist()}
    held_rows = {tuple(r) for r in held.batch(list(range(200))).tolist()}
    assert not seen & held_rows


def test_an_evaluation_larger_than_the_held_out_split_is_said(tmp_path):
    from mscale.train.data import held_out_repeats

    train, _ = make_sources(_blend(tmp_path), 3, 8, 256)
    held = train.held_out
    counts = {p.dataset.url: p.packed.count for p in held.parts}
    a, b = str(tmp_path / "a"), str(tmp_path / "b.bin")
    assert held_out_repeats(train, 30) is None  # a's share 20 of its 28, b's 10 of 74
    note = held_out_repeats(train, 51)  # a's share 34 of its 28
    assert note.startswith("each evaluation reads 51 held-out samples")
    assert f"{a}: 34 reads of {counts[a]} samples" in note and b not in note
    assert "eval_fraction" in note
    assert held_out_repeats(make_sources(DataConfig(), 3, 8, 256)[0], 10**6) is None  # synthetic


def test_samples_after_a_resume_equal_an_uninterrupted_runs(tmp_path):
    """Resume and batch change count on from the checkpoint's samples: the same global indices,
    hence the same tokens, as a run that never stopped (blended, shuffled data)."""
    source = make_source(_blend(tmp_path), 3, 8, 256)
    plan = BatchPlan(8, 2, 2, 1)
    straight = DataLoader(source, plan, read_ahead=2)
    want = [straight.get(s, j)[0] for s in range(6) for j in range(2)]
    resumed = DataLoader(source, plan, read_ahead=2)
    resumed.resume_from(3, 24, counts_skips=True)
    got = [resumed.get(s, j)[0] for s in range(3, 6) for j in range(2)]
    for a, b in zip(want[6:], got):
        assert torch.equal(a, b)
    straight.close(), resumed.close()


def test_read_ahead_returns_what_a_direct_read_returns_and_raises_its_errors():
    calls = []

    def read(ids):
        calls.append(tuple(ids))
        if ids[0] == 99:
            raise MscaleError("store down", file="memory://x")
        return torch.tensor(ids)

    ahead = ReadAhead(read, depth=3)
    follow = ([k, k + 1] for k in range(2, 100, 2))
    assert ahead.take([0, 1], follow).tolist() == [0, 1]
    assert ahead.take([2, 3], ([k, k + 1] for k in range(4, 100, 2))).tolist() == [2, 3]
    assert calls.count((2, 3)) == 1  # read once, ahead of the ask
    with pytest.raises(MscaleError, match="store down"):
        ahead.take([99], iter(()))
    ahead.close()


def test_the_synthetic_stream_is_the_documented_chain():
    """Each token is the successor of the one before unless the noise draw picks a random one;
    the values must never change (a resumed run checks the source's fingerprint)."""
    src = SyntheticTokens(1234, 64, 500)
    for k in (0, 3, 1000):
        g = torch.Generator().manual_seed(1234 * 1_000_003 + k)
        rand = torch.randint(0, 500, (65,), generator=g)
        keep = torch.rand(65, generator=g) >= 0.1
        want = [int(rand[0])]
        for i in range(1, 65):
            want.append(int(src.successor[want[-1]]) if keep[i] else int(rand[i]))
        got = src.sample(k)
        assert got.dtype == torch.int64 and got.tolist() == want


def test_the_latest_epoch_of_each_source_shows_when_it_starts_over(tmp_path):
    with IndexedWriter(str(tmp_path / "a"), np.uint16) as w:
        for _ in range(10):
            w.add_document(np.arange(50) % 100)  # 500 tokens: 62 samples of 8
    samples = make_source(DataConfig(path=str(tmp_path / "a")), 1, 8, 256).samples
    assert samples.latest_epochs(0, 16) == {str(tmp_path / "a"): 0}
    assert samples.latest_epochs(48, 16) == {str(tmp_path / "a"): 1}  # 62 is in epoch 1


def test_a_tokenizer_larger_than_the_models_vocabulary_is_refused_naming_the_dataset(tmp_path):
    """A prepared folder records its tokenizer's vocabulary: one the model cannot embed is bad
    input before any sample is read."""
    import json

    folder = tmp_path / "tokens"
    folder.mkdir()
    with IndexedWriter(str(folder / "shard-00000"), np.uint16) as w:
        w.add_document(np.arange(200) % 100)
        info = w.close()
    (folder / "manifest.json").write_text(json.dumps({
        "format": "mscale-tokens", "version": 1, "tokenizer": "t.json", "vocab_size": 300,
        "eod_id": 0, "dtype": "uint16", "tokens": info["tokens"],
        "documents": info["documents"], "shards": [{**info, "prefix": "shard-00000"}]}))
    with pytest.raises(MscaleError, match="tokenizer has 300 tokens, the model embeds 256") as e:
        make_source(DataConfig(path=str(folder)), 0, 8, 256)
    assert e.value.file == str(folder) and e.value.field == "training.data.path"


def test_a_flat_uint32_file_is_not_read_at_the_default_uint16_for_a_large_vocabulary(tmp_path):
    """A Llama-3 tokenizer's uint32 .bin read as uint16 gave ids all below a 128k vocabulary
    ([43561, 1, 16158, 1, ...]), and trained on noise without a word."""
    path = tmp_path / "llama3.bin"
    np.array([108_137, 16_158, 84_000, 20] * 64, dtype=np.uint32).tofile(path)
    with pytest.raises(MscaleError, match="read as uint16 .data.dtype's default., but the model "
                                          "embeds 128,256 ids") as e:
        make_source(DataConfig(path=str(path)), 0, 8, 128_256)
    assert e.value.field == "training.data.path" and "data.dtype: uint32" in e.value.fix
    src = make_source(DataConfig(path=str(path), dtype="uint32"), 0, 8, 128_256)  # said: read
    assert src is not None


def test_a_source_re_prepared_at_its_path_is_named_on_resume_whatever_sample_zero_is(tmp_path):
    """The user's trial: src_a re-prepared with fewer documents; the checkpoint's first sample
    may come from src_b, but its per-source records name src_a."""
    from mscale.ckpt.manifest import TrainState
    from mscale.config.training import TrainingConfig
    from mscale.train.data import source_fingerprint
    from mscale.train.resumed import resume_notes

    rng = np.random.default_rng(0)
    docs = [rng.integers(1, 256, 40).tolist() for _ in range(12)]
    prepared(tmp_path / "src_a", docs, vocab_size=256)
    prepared(tmp_path / "src_b", docs[::-1], vocab_size=256)
    cfg = DataConfig(sources=[{"path": str(tmp_path / "src_a")},
                              {"path": str(tmp_path / "src_b"), "weight": 3.0}], eval_fraction=0.2)
    before = source_fingerprint(make_source(cfg, 3, 8, 256))
    assert [(s["path"], s["weight"], s["documents"]) for s in before.sources] == [
        (str(tmp_path / "src_a"), 1.0, 12), (str(tmp_path / "src_b"), 3.0, 12)]
    state = TrainState.model_validate(TrainState(  # as a checkpoint writes and reads it back
        step=4, samples=64, data_fingerprint=before.checksum, data_sources=before.sources)
        .model_dump(mode="json"))
    training = TrainingConfig(global_batch=16, steps=8, data=cfg)
    assert resume_notes(state, training, source_fingerprint(make_source(cfg, 3, 8, 256)),
                        True, "ck") == []
    prepared(tmp_path / "src_a", docs[:7], vocab_size=256)
    after = source_fingerprint(make_source(cfg, 3, 8, 256))
    with pytest.raises(MscaleError) as e:
        resume_notes(state, training, after, True, "ck")
    assert f"{tmp_path / 'src_a'} was re-prepared or changed (12 -> 7 documents, 480 -> 280 " \
           "tokens)" in e.value.message


def test_held_out_sources_given_apart_are_recorded_too(tmp_path):
    from mscale.train.data import source_fingerprint

    prepared(tmp_path / "a", [[1, 2, 3] * 10] * 4, vocab_size=256)
    prepared(tmp_path / "held", [[4, 5, 6] * 10] * 4, vocab_size=256)
    cfg = DataConfig(path=str(tmp_path / "a"), eval_sources=[{"path": str(tmp_path / "held")}])
    roles = [(s["role"], s["path"]) for s in source_fingerprint(make_source(cfg, 0, 8, 256)).sources]
    assert roles == [("train", str(tmp_path / "a")), ("eval", str(tmp_path / "held"))]


def test_a_held_out_shard_a_training_glob_includes_is_refused(tmp_path):
    """The names differ (`web/shard-*` against `web/shard-00001`), the file is the same: its
    "held-out" loss would be measured on trained-on tokens."""
    web = tmp_path / "web"
    web.mkdir()
    for i in range(2):
        with IndexedWriter(str(web / f"shard-{i:05d}"), np.uint16) as w:
            for _ in range(4):
                w.add_document(np.arange(1, 31) % 200)
    cfg = DataConfig(path=str(web / "shard-*"),
                     eval_sources=[{"path": str(web / "shard-00001")}])
    with pytest.raises(MscaleError, match="1 of its shard file.s. are also read for training") \
            as e:
        make_source(cfg, 0, 8, 256)
    assert e.value.field == "training.data.eval_sources[0].path"


def test_a_held_out_split_nobody_evaluates_is_said():
    from mscale.config.training import TrainingConfig
    from mscale.train.data import never_evaluated

    def cfg(**kw):
        return TrainingConfig.model_validate({"global_batch": 8, **kw})

    assert "never evaluated" in never_evaluated(cfg(data={"path": "a", "eval_fraction": 0.05}))
    assert never_evaluated(cfg(data={"path": "a", "eval_fraction": 0.05},
                               eval={"interval": 10})) is None
    assert never_evaluated(cfg(data={"path": "a"})) is None  # nothing held out
    assert never_evaluated(cfg()) is None  # synthetic: its held-out stream costs nothing


@pytest.mark.parametrize("train, held", [
    ("data/a", "data/a"), ("data/a/", "./data/a"), ("s3://b/a", "s3://b/a"),
    ("s3://b/a/", "s3://b/a"), ("data/a", "data/x/../a"),  # spelled otherwise (helper-46)
    (f"file://{os.path.abspath('data/a')}", "data/a"), ("data/a", f"file://{os.getcwd()}/data/a/")])
def test_a_held_out_source_that_is_also_trained_on_is_refused_when_the_run_opens_it(train, held):
    """Its "held-out" loss would be measured on training tokens (helper-42's trial: accepted).
    The schema still loads it: a plan recorded before the check (RUN/plan.yaml, a checkpoint's
    manifest) must not make the run's checkpoints unreadable (helper-43's review)."""
    from mscale.data.blend import open_sources

    cfg = DataConfig(sources=[{"path": train}, {"path": "other"}], eval_sources=[{"path": held}])
    with pytest.raises(MscaleError, match="also a training source") as e:
        open_sources(cfg)
    assert e.value.field == "training.data.eval_sources[0].path"


def test_the_launchers_identity_of_the_data_is_the_workers(tmp_path):
    """The --local launcher refuses a changed source before any worker starts, from the splits
    it opened (numpy, no torch); the workers' identity comes from their loader. Were the two to
    differ, every restart under --local would be refused as "data changed"."""
    from mscale.data.blend import build_splits
    from mscale.train.data import source_fingerprint
    from mscale.train.resumed import split_identity

    prepared(tmp_path / "a", [[1, 2, 3] * 10] * 6, vocab_size=256)
    prepared(tmp_path / "held", [[4, 5, 6] * 10] * 4, vocab_size=256)
    np.arange(2000, dtype=np.uint16).tofile(tmp_path / "flat.bin")
    cfg = DataConfig(sources=[{"path": str(tmp_path / "a")},
                              {"path": str(tmp_path / "flat.bin"), "weight": 2.0}],
                     eval_sources=[{"path": str(tmp_path / "held")}])
    launcher = split_identity(*build_splits(cfg, 8, 5, 4096))
    assert launcher == source_fingerprint(make_source(cfg, 5, 8, 4096))
    assert len(launcher.sources) == 3
