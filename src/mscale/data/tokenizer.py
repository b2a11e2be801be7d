"""Tokenizers for `mscale data`: a local ``tokenizer.json`` read, the end-of-document id found,
a small byte-level BPE trained locally.

Only local files: mscale never downloads a tokenizer from a hub (training machines often have no
network, and a run must name exactly the file it used; prepare records its sha256). A HuggingFace
model folder works when it holds ``tokenizer.json`` (the "fast" tokenizer every recent model ships).
"""

from __future__ import annotations

import hashlib
import json
import os
import threading
import time
from typing import TYPE_CHECKING, Callable, Iterable

from mscale.data.corpus import Skipped, expand_inputs, input_size, iter_documents
from mscale.data.storage import check_parents
from mscale.errors import MscaleError

if TYPE_CHECKING:  # tokenizers is imported where it is used: `mscale data inspect` needs none
    from tokenizers import Tokenizer

TOKENIZER_JSON = "tokenizer.json"
EOD_NAMES = ("<|endoftext|>", "<|end_of_text|>", "</s>", "<eos>", "<|eos|>", "[EOS]", "<EOS>",
             "<end_of_text>", "<|end|>")
"""End-of-document tokens by name, the first one the vocabulary has wins: GPT-2/GPT-NeoX/Qwen,
Llama 3 (not ``<|eot_id|>``, which ends a chat turn), Llama 2/Mistral/T5, Gemma, others."""
SPECIAL = "<|endoftext|>"
"""The one special token of a tokenizer `train_tokenizer` writes (id 0)."""
MIN_VOCAB = 257
"""256 byte symbols plus the special token: a byte-level BPE can encode anything with these."""
MAX_VOCAB = 1 << 20
WAIT_S = 0.5
"""How often `train_tokenizer` reports while the training runs (the merges take seconds to
minutes with nothing else to show)."""

_HOW_TO_GET = ("save the model's tokenizer.json on a machine with network (e.g. `hf download "
               "ORG/MODEL tokenizer.json --local-dir DIR`), then pass that file or DIR; or train "
               "one locally with `mscale data tokenizer`")


def tokenizer_path(spec: str) -> str:
    """The local ``tokenizer.json`` that ``spec`` names: the file itself or a folder holding it.

    Anything else is refused with the fix: a URL (nothing is downloaded), a hub name such as
    ``meta-llama/Llama-3.1-8B`` that is not a local path, a folder with only a SentencePiece
    ``tokenizer.model``.
    """
    text = str(spec)
    if text.startswith("file://"):
        text = text[len("file://"):]
    elif "://" in text:
        raise MscaleError("a tokenizer is read from a local file only; mscale never downloads one",
                          file=text, field="--tokenizer", fix=_HOW_TO_GET)
    path = os.path.expanduser(text)
    if os.path.isdir(path):
        inner = os.path.join(path, TOKENIZER_JSON)
        if os.path.isfile(inner):
            return inner
        if os.path.isfile(os.path.join(path, "tokenizer.model")):
            raise MscaleError("this folder holds a SentencePiece tokenizer.model but no "
                              "tokenizer.json", file=text, field="--tokenizer",
                              fix="write tokenizer.json once with transformers: "
                                  "AutoTokenizer.from_pretrained(DIR).save_pretrained(DIR)")
        raise MscaleError("this folder holds no tokenizer.json", file=text, field="--tokenizer",
                          fix=_HOW_TO_GET)
    if os.path.isfile(path):
        return path
    hub_like = text.count("/") == 1 and not text.startswith((".", "/", "~"))
    raise MscaleError("tokenizer not found" + (" (a hub name? mscale never downloads)"
                                               if hub_like else ""),
                      file=text, field="--tokenizer", fix=_HOW_TO_GET)


def read_tokenizer(spec: str) -> tuple[str, str, str]:
    """(path, JSON text, sha256 of the file's bytes) of the tokenizer ``spec`` names, checked to
    load. Workers rebuild it from the JSON text, so every process uses the bytes hashed here."""
    path = tokenizer_path(spec)
    with open(path, "rb") as f:
        raw = f.read()
    try:
        text = raw.decode("utf-8")
    except UnicodeDecodeError as e:
        raise MscaleError(f"not a tokenizer.json: byte {e.start} is not UTF-8", file=path,
                          field="--tokenizer", fix=_HOW_TO_GET) from None
    _parse(text, path)
    return path, text, hashlib.sha256(raw).hexdigest()


def _parse(text: str, path: str) -> "Tokenizer":
    from tokenizers import Tokenizer

    try:
        return Tokenizer.from_str(text)
    except Exception as e:  # noqa: BLE001 - tokenizers raises a bare Exception on a bad file
        detail = " ".join(str(e).split())[:200]
        raise MscaleError(f"not a valid tokenizer.json ({detail})", file=path,
                          field="--tokenizer", fix=_HOW_TO_GET) from None


def load_tokenizer(spec: str) -> "Tokenizer":
    """The `tokenizers.Tokenizer` of a local ``tokenizer.json`` or a folder holding one."""
    path, text, _ = read_tokenizer(spec)
    return _parse(text, path)


def vocab_of(tok: "Tokenizer") -> int:
    """Ids run below this: the model vocabulary and the added (special) tokens together."""
    ids = [tok.get_vocab_size(with_added_tokens=True)]
    ids += [i + 1 for i in tok.get_added_tokens_decoder()]  # an added id past the vocabulary
    return max(ids)


def vocab_sha256(tok: "Tokenizer") -> str:
    """sha256 of what each id stands for (every token and added token with its id): the same
    for a tokenizer.json re-saved with other whitespace or key order, or by another version of
    `tokenizers`, whose file bytes (``tokenizer_sha256``) differ; another for another
    vocabulary. What a blend's sources must share (`blend.check_one_tokenizer`)."""
    text = json.dumps(tok.get_vocab(with_added_tokens=True), sort_keys=True,
                      separators=(",", ":"), ensure_ascii=False)
    return hashlib.sha256(text.encode("utf-8")).hexdigest()


def recorded_vocab_sha256(path: str | None, file_sha256: str | None) -> str | None:
    """`vocab_sha256` of the tokenizer a manifest written before it recorded one names, when
    the file is still at ``path`` with the bytes recorded (``file_sha256``); None otherwise."""
    if not path or not file_sha256:
        return None
    try:
        recorded, text, sha = read_tokenizer(path)
    except (OSError, MscaleError):
        return None
    return vocab_sha256(_parse(text, recorded)) if sha == file_sha256 else None


def eod_id(tok: "Tokenizer", eod: str | None = None, *, file: str | None = None) -> int:
    """The end-of-document token's id: ``eod`` (a token such as ``</s>``, or digits: an id)
    when given, else the first of `EOD_NAMES` the vocabulary has; none found is an error with
    the fix."""
    if eod is not None:
        if eod.strip().isdigit():  # an id: digits never name a token here ("5" is a byte token)
            if int(eod) < vocab_of(tok):
                return int(eod)
            raise MscaleError(f"id {eod} is outside the vocabulary ({vocab_of(tok)} ids)",
                              file=file, field="--eod",
                              fix=f"pass an id below {vocab_of(tok)}, or a token such as </s>")
        found = tok.token_to_id(eod)
        if found is not None:
            return found
        raise MscaleError(f"the tokenizer has no token {eod!r}", file=file, field="--eod",
                          fix="pass a token the vocabulary has (its special tokens: "
                              f"{_specials(tok)}) or an id below {vocab_of(tok)}")
    for name in EOD_NAMES:
        found = tok.token_to_id(name)
        if found is not None:
            return found
    raise MscaleError("the tokenizer has none of the usual end-of-document tokens "
                      f"({', '.join(EOD_NAMES)})", file=file, field="--eod",
                      fix="name it with --eod TOKEN (its special tokens: "
                          f"{_specials(tok)})")


def _specials(tok: "Tokenizer") -> str:
    names = [t.content for _, t in sorted(tok.get_added_tokens_decoder().items())]
    shown = ", ".join(names[:12]) + (", ..." if len(names) > 12 else "")
    return shown or "none"


def new_bpe() -> tuple["Tokenizer", type]:
    """An untrained byte-level BPE (GPT-2's scheme) and the trainer class that fills it."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers

    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    return tok, trainers.BpeTrainer


def train_bpe(texts: Iterable[str], vocab: int) -> "Tokenizer":
    """A byte-level BPE of ``vocab`` ids (``<|endoftext|>`` = 0, then the 256 bytes, then merges)
    trained on ``texts``."""
    from tokenizers import pre_tokenizers

    _check_vocab(vocab)
    tok, trainer_cls = new_bpe()
    trainer = trainer_cls(vocab_size=vocab, special_tokens=[SPECIAL], show_progress=False,
                          initial_alphabet=pre_tokenizers.ByteLevel.alphabet())
    tok.train_from_iterator(texts, trainer=trainer)
    return tok


def _check_vocab(vocab: int) -> None:
    if not MIN_VOCAB <= vocab <= MAX_VOCAB:
        raise MscaleError(f"vocabulary size {vocab} is out of range", field="--vocab",
                          fix=f"pass {MIN_VOCAB} (the 256 bytes and {SPECIAL}) to {MAX_VOCAB}; "
                              "1,000-4,000 suits a few MB of text")


def _train_watched(texts: Iterable[str], vocab: int, on_wait: Callable[[], None]) -> "Tokenizer":
    """`train_bpe` on a daemon thread while this one calls ``on_wait`` every `WAIT_S`: the
    merges gave no sign of life (13 s on 28 MB), and Ctrl-C waited for them (tokenizers releases
    the GIL while it trains, measured). A daemon thread, so an interrupted process need not wait
    for it either."""
    result: dict = {}

    def run() -> None:
        try:
            result["tok"] = train_bpe(texts, vocab)
        except BaseException as e:  # noqa: BLE001 - raised again in the calling thread
            result["error"] = e

    worker = threading.Thread(target=run, name="mscale-bpe", daemon=True)
    worker.start()
    while True:
        worker.join(WAIT_S)
        if not worker.is_alive():
            break
        on_wait()
    if "error" in result:
        raise result["error"]
    return result["tok"]


def train_tokenizer(files: list[str], vocab_size: int, out: str, *, text_field: str = "text",
                    column: str = "text", text_exts: Iterable[str] = (), force: bool = False,
                    progress: Callable[[int, int, float | None], None] | None = None,
                    on_start: Callable[[dict], None] | None = None,
                    on_skip: Callable[[MscaleError], None] | None = None) -> dict:
    """Train a byte-level BPE on the documents of ``files`` (files, folders, globs: what
    `mscale.data.corpus` reads, as `prepare` does) and save it to ``out`` atomically.

    ``on_skip`` (``--skip-bad``): unreadable records and files are skipped, each handed to it,
    as `prepare` does; the result then also has ``skipped_count`` and ``skipped`` (the first
    `corpus.SKIPPED_LISTED`, ``{"where", "why"}``), as its manifest does.

    ``on_start`` gets what was resolved before any work (files, bytes, vocabulary, out);
    ``progress`` is called every `WAIT_S` from this thread with (documents read, bytes read,
    seconds spent computing the merges once every document is read, else None). ``on_skip`` is
    called from the training thread.

    Returns ``{"out", "vocab_size", "eod_id", "documents", "bytes", "sha256"}``.
    """
    out = _check_out(str(out), force)
    _check_vocab(vocab_size)
    sources = expand_inputs(files, text_exts=text_exts)
    if on_start is not None:
        on_start({**input_size(sources), "vocab_size": vocab_size, "out": out})
    skipped = Skipped(on_skip) if on_skip is not None else None
    counts: dict = {"documents": 0, "bytes": 0, "read_at": None}

    def texts():
        for text, nbytes in iter_documents(sources, text_field=text_field, column=column,
                                           on_bad=skipped):
            counts["bytes"] += nbytes
            if not text:
                continue
            counts["documents"] += 1
            yield text
        counts["read_at"] = time.monotonic()  # the merges start

    def waiting() -> None:
        if progress is not None:
            read_at = counts["read_at"]
            progress(counts["documents"], counts["bytes"],
                     None if read_at is None else time.monotonic() - read_at)

    tok = _train_watched(texts(), vocab_size, waiting)
    if counts["documents"] == 0:
        why = (f"every input is empty or skipped ({skipped.count:,} unreadable)"
               if skipped is not None and skipped.count else "every input is empty")
        raise MscaleError(f"no documents to train on ({why})",
                          file=", ".join(files), fix="pass files that hold text")
    text = tok.to_str(pretty=False)
    data = text.encode("utf-8")
    _write_atomic(out, data)
    result = {"out": out, "vocab_size": vocab_of(tok), "eod_id": tok.token_to_id(SPECIAL),
              "documents": counts["documents"], "bytes": counts["bytes"],
              "sha256": hashlib.sha256(data).hexdigest()}
    return {**result, **skipped.record()} if skipped is not None else result


def _check_out(out: str, force: bool) -> str:
    """The local file to write: a folder gets ``tokenizer.json`` inside; a URL or an existing
    file (without ``force``) is refused."""
    if out.endswith(os.sep) or os.path.isdir(out):
        out = os.path.join(out, TOKENIZER_JSON)
    if "://" in out and not out.startswith("file://"):
        raise MscaleError("a tokenizer is written to a local file", file=out, field="--out",
                          fix="pass a local path, e.g. --out tokenizer.json")
    if os.path.lexists(out.removeprefix("file://")) and not force:
        raise MscaleError("the tokenizer file already exists", file=out, field="--out",
                          fix="choose another --out, or pass --force to overwrite it")
    path = out.removeprefix("file://")
    if not os.path.lexists(path):
        check_parents(path, out, "--out")
    return path


def _write_atomic(path: str, data: bytes) -> None:
    folder = os.path.dirname(os.path.abspath(path))
    os.makedirs(folder, exist_ok=True)
    tmp = f"{path}.tmp-{os.getpid()}"
    try:
        with open(tmp, "wb") as f:
            f.write(data)
            f.flush()
            os.fsync(f.fileno())
        os.replace(tmp, path)
    except BaseException:
        try:
            os.remove(tmp)
        except FileNotFoundError:
            pass
        raise
