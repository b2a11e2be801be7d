"""A training file's datasets as one sample source: global index → seq_len+1 tokens.

The sources (`indexed.open_dataset`) are cut into a train and a held-out range at a document
boundary (`sampling.split_documents`), or held-out sources are given apart; each range is packed
into samples across document boundaries (`sampling.PackedSamples`), and the samples are blended
by weight and shuffled per epoch (`sampling.Mixture`). Every step is pure index arithmetic, so
sample k is the same on every rank, at every layout, after any restart: no loader state.
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np

from mscale.config.training import DataConfig, DataSource
from mscale.data.datasets import SourceNotFound, open_dataset, uint32_read_as_uint16
from mscale.data.indexed import TokenDataset
from mscale.data.manifest import MANIFEST
from mscale.data.sampling import Mixture, PackedSamples, split_documents
from mscale.data.storage import Retry, join, set_default_retry
from mscale.data.tokenizer import recorded_vocab_sha256
from mscale.errors import MscaleError
from mscale.urls import location_key

EVAL_SEED_SALT = 0x5EED_E7A1
"""Mixed into the seed of the held-out order, so it is not the training order's."""


@dataclass(frozen=True)
class Part:
    """One source's range of one split."""

    dataset: TokenDataset
    packed: PackedSamples
    field: str
    """Where the source is named in the training file, for errors."""


class BlendedSamples:
    """The samples of one split (``"train"`` or ``"eval"``) of a training file's datasets."""

    def __init__(self, parts: list[Part], weights: list[float], seed: int, shuffle: bool,
                 vocab: int | None = None):
        self.parts, self.seq_len = parts, parts[0].packed.seq_len
        self.weights, self.vocab = list(weights), vocab
        self.mixture = Mixture([p.packed.count for p in parts], weights, seed, shuffle)

    @property
    def sources(self) -> list[str]:
        return [p.dataset.url for p in self.parts]

    def samples(self, ks: list[int] | np.ndarray) -> np.ndarray:
        """[len(ks), seq_len + 1] int64 tokens."""
        source, sample = self.mixture.locate(np.asarray(ks, dtype=np.int64))
        out = np.empty((len(source), self.seq_len + 1), dtype=np.int64)
        starts = []
        for row, (i, j) in enumerate(zip(source.tolist(), sample.tolist())):
            packed = self.parts[i].packed
            start = packed.start + j * self.seq_len
            out[row] = self.parts[i].dataset.read(start, start + self.seq_len + 1)
            starts.append(start)
        if self.vocab is not None and out.size and (int(out.max()) >= self.vocab
                                                    or int(out.min()) < 0):
            # `check_vocab` reads only each source's first MiB at open: an id past the
            # embedding further in would otherwise stop a rank with torch's bare IndexError,
            # a "crash" that recover relaunches into the same sample. Negative: an int32
            # dataset's -1 (a tokenizer's pad id), which the embedding refuses as well
            bad = (out.max(axis=1) >= self.vocab) | (out.min(axis=1) < 0)
            row = int(np.argmax(bad))
            part, start = self.parts[int(source[row])], starts[row]
            low, high = int(out[row].min()), int(out[row].max())
            what = (f"token id {low} < 0" if low < 0 else
                    f"token id {high} >= the model's vocab {self.vocab}")
            raise MscaleError(f"{what} in tokens [{start:,}, "
                              f"{start + self.seq_len + 1:,}) of this source",
                              file=part.dataset.url, field=part.field,
                              fix="re-prepare the source with the model's tokenizer (mscale "
                                  "data verify names a damaged shard), or check the dtype of a "
                                  "flat file")
        return out

    def sample(self, k: int) -> np.ndarray:
        return self.samples([k])[0]

    def epochs(self, ks) -> np.ndarray:
        """The epoch of its source each global index is in (0 first)."""
        return self.mixture.epochs(np.asarray(ks, dtype=np.int64))

    def latest_epochs(self, first: int, count: int) -> dict[str, int]:
        """Source → the latest epoch (0 first) that samples ``first .. first+count-1`` reach:
        a source that ran out and started over shows here first."""
        ks = np.arange(first, first + count, dtype=np.int64)
        source, j = self.mixture.blend.locate(ks)
        epoch = j // self.mixture.counts[source]
        return {self.parts[i].dataset.url: int(epoch[source == i].max())
                for i in np.unique(source).tolist()}


def check_held_out_apart(cfg: DataConfig, field: str = "training.data") -> None:
    """A held-out source that is also a training source would measure its "held-out" loss on
    trained-on tokens. Checked where a run opens its data, not in the schema: plans recorded
    before this check (RUN/plan.yaml, a checkpoint's manifest) must still load."""
    trained = {location_key(s.path) for s in cfg.train_sources}
    for i, s in enumerate(cfg.eval_sources):
        if location_key(s.path) in trained:
            raise MscaleError(f"{s.path} is also a training source: its held-out loss would be "
                              "measured on tokens the model trains on",
                              field=f"{field}.eval_sources[{i}].path",
                              fix="name a held-out source it does not train on, or hold out the "
                                  "end of each source with eval_fraction")


def check_sources_distinct(cfg: DataConfig, field: str = "training.data") -> None:
    """A source listed twice in ``sources`` (or ``eval_sources``), however spelled
    (`location_key`), is almost surely a typo for another source: blended twice, it would get
    the sum of both weights without a word. Refused, naming the second entry and both fixes.
    Checked where a run opens its data, as `check_held_out_apart` is."""
    for key, sources in (("sources", cfg.sources), ("eval_sources", cfg.eval_sources)):
        first: dict[str, int] = {}
        for i, s in enumerate(sources):
            j = first.setdefault(location_key(s.path), i)
            if j == i:
                continue
            raise MscaleError(f"{s.path} is listed twice (also {key}[{j}]: {sources[j].path}): "
                              "it would be blended twice, with the sum of both weights",
                              field=f"{field}.{key}[{i}].path",
                              fix="if it is a typo, name the source you meant; to give it more "
                                  f"weight, keep one entry with weight "
                                  f"{sources[j].weight + s.weight:g} (both summed; a run that "
                                  "trained with both entries resumes on the one with "
                                  "--allow-data-change, as for any change of its data)")


def open_sources(cfg: DataConfig, field: str = "training.data"
                 ) -> list[tuple[DataSource, TokenDataset, str]]:
    """Open every source named by the training file (train, then held-out): (source, dataset,
    field naming it). Raises the first source's error with its field attached."""
    check_sources_distinct(cfg, field)
    check_held_out_apart(cfg, field)
    set_default_retry(Retry.within(cfg.remote_retry_s))  # every read of this process's sources
    # data.dtype speaks for flat files only; an index records its own (a default is no claim)
    dtype = cfg.dtype if "dtype" in cfg.model_fields_set else None
    named = ([(s, f"{field}.path" if cfg.path else f"{field}.sources[{i}].path")
              for i, s in enumerate(cfg.train_sources)]
             + [(s, f"{field}.eval_sources[{i}].path") for i, s in enumerate(cfg.eval_sources)])
    opened = []
    for source, where in named:
        try:
            opened.append((source, open_dataset(source.path, dtype=dtype, flat_only=True),
                           where))
        except SourceNotFound as e:  # the field's own error: the caller may name the plan file
            e.message, e.file, e.field = f"{source.path}: {e.message}", None, where
            if e.relative:
                e.fix = ("if it is not prepared yet, create it (mscale data prepare INPUT... "
                         f"--tokenizer TOKENIZER --out {source.path}; docs/data.md); if it is "
                         "elsewhere, run mscale from the directory the plan's data paths are "
                         f"relative to, or write an absolute path in {where}")
            raise
        except MscaleError as e:
            if e.field is None or not e.field.startswith("training."):
                e.message = f"{e.message} (named by {where})"
            raise
    return opened


def build_splits(cfg: DataConfig, seq_len: int, seed: int, vocab: int,
                 field: str = "training.data") -> tuple[BlendedSamples, BlendedSamples | None]:
    """(train samples, held-out samples or None) of a training file's ``data`` section."""
    opened = open_sources(cfg, field)
    for _, ds, where in opened:
        check_vocab(ds, vocab, where, dtype_given="dtype" in cfg.model_fields_set)
    check_one_tokenizer(opened)
    n_train = len(cfg.train_sources)
    _check_no_shard_shared(opened[:n_train], opened[n_train:])
    train, held = [], []
    for source, ds, where in opened[:n_train]:
        try:
            (a, b), (c, d) = split_documents(ds.num_tokens, cfg.eval_fraction, seq_len,
                                             ds.next_document_start)
        except MscaleError as e:
            if e.file is not None:  # the index read for the cut: its own file is the culprit
                e.message = f"{e.message} (named by {where})"
                raise
            raise MscaleError(f"{e.message} in this source ({ds.num_tokens:,} tokens, "
                              f"{_documents(ds)})", file=ds.url,
                              field=e.field or f"{field}.eval_fraction", fix=e.fix) from None
        train.append((Part(ds, _packed(ds, seq_len, a, b, where), where), source.weight))
        if d > c:
            held.append((Part(ds, _packed(ds, seq_len, c, d, where), where), source.weight))
    for source, ds, where in opened[n_train:]:
        part = Part(ds, _packed(ds, seq_len, 0, ds.num_tokens, where), where)
        held.append((part, source.weight))
    train_samples = BlendedSamples([p for p, _ in train], [w for _, w in train], seed, cfg.shuffle,
                                   vocab)
    eval_samples = None
    if held:
        eval_samples = BlendedSamples([p for p, _ in held], [w for _, w in held],
                                      seed ^ EVAL_SEED_SALT, cfg.shuffle, vocab)
    return train_samples, eval_samples


def _documents(ds: TokenDataset) -> str:
    if ds.documents is None:
        return "no document boundaries"
    return f"{ds.documents:,} document{'' if ds.documents == 1 else 's'}"


def _packed(ds: TokenDataset, seq_len: int, start: int, stop: int, where: str) -> PackedSamples:
    try:
        return PackedSamples(ds.num_tokens, seq_len, start, stop)
    except MscaleError as e:
        raise MscaleError(e.message, file=ds.url, field=where, fix=e.fix) from None


def _check_no_shard_shared(train: list, held: list) -> None:
    """The files each held-out source opened, against the training sources': the names alone
    (`check_held_out_apart`) miss a glob or a folder that holds the held-out shard."""
    trained = {location_key(sh.blob.url) for _, ds, _ in train for sh in ds.shards}
    for _, ds, where in held:
        shared = [sh.blob.url for sh in ds.shards if location_key(sh.blob.url) in trained]
        if shared:
            raise MscaleError(f"{len(shared)} of its shard file(s) are also read for training "
                              f"({shared[0]}): its held-out loss would be measured on tokens the "
                              "model trains on", file=ds.url, field=where,
                              fix="name held-out shards that no training source's glob or "
                                  "folder includes, or hold out with eval_fraction")


def _tokenizer(ds: TokenDataset) -> tuple:
    return ds.tokenizer_sha256, ds.vocab_size, ds.eod_id


def check_one_tokenizer(opened: list) -> None:
    """Refuse prepared sources (train and held-out) whose manifests record different
    tokenizers: id 417 would be one word in a source and another in the next, so the model
    learns noise, and every id still lies below model.vocab, so no other check sees it.
    Sources without a manifest record no tokenizer and are not compared."""
    known = [(s, ds, where) for s, ds, where in opened if ds.vocab_size is not None]
    if not known:
        return
    first, ref, ref_where = known[0]
    for source, ds, where in known[1:]:
        a, b = _tokenizer(ref), _tokenizer(ds)
        # a manifest without a checksum is compared by vocabulary and EOD alone
        same = a[1:] == b[1:] and (None in (a[0], b[0]) or a[0] == b[0]
                                   or _same_vocabulary(ref, ds))
        if not same:
            raise MscaleError(
                f"prepared with another tokenizer than {first.path} ({ref_where}): "
                f"{_describe(ds)} against {_describe(ref)}: the same id would stand for "
                "different text in each source", file=join(ds.url, MANIFEST), field=where,
                fix="prepare every source with the model's one tokenizer (mscale data prepare "
                    f"INPUT... --tokenizer TOKENIZER --out {source.path} --force)")


def _same_vocabulary(a: TokenDataset, b: TokenDataset) -> bool:
    """Two tokenizer files of other bytes that give every id the same token: one tokenizer
    re-saved (pretty-printed, keys reordered, another `tokenizers` version), whose sources hold
    the same ids for the same text. A manifest from before ``vocab_sha256`` is judged by its
    tokenizer file, when that is still where it was, with the bytes it recorded."""
    for ds in (a, b):  # kept on the opened source: a blend compares each with its first
        ds.vocab_sha256 = ds.vocab_sha256 or recorded_vocab_sha256(ds.tokenizer,
                                                                   ds.tokenizer_sha256)
    return None not in (a.vocab_sha256, b.vocab_sha256) and a.vocab_sha256 == b.vocab_sha256


def _describe(ds: TokenDataset) -> str:
    sha = f", sha256 {ds.tokenizer_sha256[:12]}" if ds.tokenizer_sha256 else ""
    return f"{ds.tokenizer}{sha}, vocab {ds.vocab_size:,}, eod {ds.eod_id}"


def check_vocab(ds: TokenDataset, vocab: int, where: str, dtype_given: bool = True) -> None:
    """Refuse data whose token ids the model cannot embed: the tokenizer's vocabulary, when the
    dataset records it, and the largest id in the first MiB of tokens. A flat file read at the
    default uint16 for a model of more than 65,536 ids is refused too: a uint32 file read so
    (a Llama-3 tokenizer's) gives ids all below the vocabulary, and trains on noise."""
    if ds.documents is None and not dtype_given and ds.dtype == np.uint16 and vocab > 65536:
        raise MscaleError(f"a flat token file is read as uint16 (data.dtype's default), but the "
                          f"model embeds {vocab:,} ids, more than uint16 holds", file=ds.url,
                          field=where, fix="say how the file was written: data.dtype: uint32 "
                                           "(or uint16, if its ids really stop below 65,536)")
    if ds.vocab_size is not None and ds.vocab_size > vocab:
        raise MscaleError(f"the dataset's tokenizer has {ds.vocab_size} tokens, the model "
                          f"embeds {vocab}", file=ds.url, field=where,
                          fix="use the model's tokenizer for `mscale data prepare`, or raise "
                              "model.vocab to the tokenizer's size (model.real_vocab, when the "
                              "vocabulary is padded)")
    head = ds.read(0, min(ds.num_tokens, 1 << 20))
    misread = None if dtype_given else uint32_read_as_uint16(ds, head)
    if misread:
        raise MscaleError(f"a flat token file is read as uint16 (data.dtype's default), but "
                          f"{misread}", file=ds.url, field=where,
                          fix="say how the file was written: data.dtype: uint32 (or uint16, if "
                              "every second id really is 0)")
    top = int(head.max()) if head.size else 0
    if head.size and int(head.min()) < 0:  # an int32 dataset's -1 (a tokenizer's pad id)
        raise MscaleError(f"token id {int(head.min())} < 0", file=ds.url, field=where,
                          fix="re-prepare the source with the model's tokenizer, without "
                              "negative (padding) ids")
    if top >= vocab:
        raise MscaleError(f"token id {top} >= the model's vocab {vocab}", file=ds.url, field=where,
                          fix="check the dtype of a flat file, or the tokenizer and model.vocab "
                              "(model.real_vocab, when the vocabulary is padded)")
