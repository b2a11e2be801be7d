"""The fuzz suite's cases for `mscale plan` and `mscale train` (ckpt: fuzz_ckpt_cases.py).

A case writes one bad input into its workspace and returns the command line; test_fuzz.py runs
it and checks the report (see `Case`). Cases are generated per kind of input, so every command
that reads a YAML file gets every kind of bad file, and every number option its bad numbers.
"""

from __future__ import annotations

import os
from dataclasses import dataclass
from typing import Callable, Iterator

from tests.e2e.fuzz_inputs import ALIAS_BOMB, BAD_TEXT, DELETE, Raw, Workspace

Build = Callable[[Workspace], list[str]]


@dataclass(frozen=True)
class Case:
    """One bad input and what the command must do with it.

    The command must exit with ``code`` (one of them, when a tuple), print no traceback, name
    ``Workspace.bad`` (when the case set one) and ``field`` (when given), end an error with a
    ``fix:`` line, and leave every input as it was.
    """

    id: str
    build: Build
    code: int | tuple[int, ...] = 3
    field: str | None = None
    owner: str | None = None
    """Whose pending fix makes the case pass: the case is xfail(strict) until it lands."""
    isolate: bool = False
    """Run through the real binary under a time and memory cap: today it may hang or explode."""
    subprocess: bool = False
    """Also run it through the real binary (the in-process run covers the rest)."""

    def codes(self) -> tuple[int, ...]:
        return self.code if isinstance(self.code, tuple) else (self.code,)


FILE_KINDS = (*BAD_TEXT, "dir", "missing", "foo", *(("mode000",) if os.geteuid() else ()))
"""Every way a file argument can be wrong: bad text (`BAD_TEXT`), or not a readable file
(mode 000 only where it is unreadable: not for root)."""
SLOTS = ("cluster", "model", "training")


# -- plan -------------------------------------------------------------------------------------


def plan_argv(ws: Workspace, *extra: str, **files: str) -> list[str]:
    paths = {k: str(getattr(ws.base, k)) for k in SLOTS} | files
    return ["plan", *(a for k in SLOTS for a in (f"--{k}", paths[k])), *extra]


def _plan_file(slot: str, how: str) -> Build:
    return lambda ws: plan_argv(ws, **{slot: ws.spoil(getattr(ws.base, slot), f"{slot}.yaml", how)})


def _plan_field(slot: str, changes: dict) -> Build:
    return lambda ws: plan_argv(ws, **{slot: ws.variant(getattr(ws.base, slot), f"{slot}.yaml",
                                                        changes)})


GOOD_LAYOUT = "tp: 2\npp: 2\nmicro_batch: 2\n"

NO_HOSTLIST = {"hostlist": DELETE}
PLAN_FIELDS: list[tuple[str, str, dict, str, bool]] = [
    # (slot, id, changes, field, isolate: may hang or exhaust memory today)
    ("cluster", "nodes-1e12", {**NO_HOSTLIST, "nodes": 10**12}, "nodes", True),
    ("cluster", "nodes-1e12-text", {**NO_HOSTLIST, "nodes": Raw("1e12")}, "nodes", True),
    ("cluster", "nodes-0", {**NO_HOSTLIST, "nodes": 0}, "nodes", False),
    ("cluster", "gpus-per-node-0", {"gpus_per_node": 0}, "gpus_per_node", False),
    ("cluster", "gpus-per-node-1e9", {"gpus_per_node": 10**9}, "gpus_per_node", True),
    ("cluster", "nic-inf", {"nic_gbit_per_s": Raw(".inf")}, "nic_gbit_per_s", False),
    ("cluster", "nic-nan", {"nic_gbit_per_s": Raw(".nan")}, "nic_gbit_per_s", False),
    ("cluster", "nic-negative", {"nic_gbit_per_s": -1}, "nic_gbit_per_s", False),
    ("cluster", "nics-true", {"nics_per_node": True}, "nics_per_node", False),
    ("cluster", "gpu-unknown", {"gpu": "tpu9"}, "gpu", False),
    ("cluster", "hostlist-reversed", {"hostlist": "node[5-1]"}, "hostlist", False),
    ("cluster", "hostlist-1e9", {"hostlist": "node[1-1000000000]"}, "hostlist", True),
    ("cluster", "typo", {"nic_gbps": 10}, "nic_gbps", False),
    ("model", "layers-true", {"layers": True}, "layers", False),
    ("model", "layers-1e9", {"layers": 10**9}, "layers", True),
    ("model", "layers-0", {"layers": 0}, "layers", False),
    ("model", "hidden-wide", {"hidden": "wide"}, "hidden", False),
    ("model", "hidden-negative", {"hidden": -64}, "hidden", False),
    ("model", "hidden-fraction", {"hidden": 64.5}, "hidden", False),
    ("model", "heads-0", {"heads": 0}, "heads", False),
    ("model", "kv-heads-3", {"kv_heads": 3}, "kv_heads", False),
    ("model", "vocab-inf", {"vocab": Raw(".inf")}, "vocab", False),
    ("model", "seq-len-1e12", {"seq_len": 10**12}, "seq_len", True),
    ("model", "mlp-unknown", {"mlp": "relu9"}, "mlp", False),
    ("model", "typo", {"hiden": 64}, "hiden", False),
    ("training", "lr-inf", {"lr": Raw(".inf")}, "lr", False),
    ("training", "lr-nan", {"lr": Raw(".nan")}, "lr", False),
    ("training", "beta1-nan", {"beta1": Raw(".nan")}, "beta1", False),
    ("training", "beta2-negative", {"beta2": -1}, "beta2", False),
    ("training", "eps-negative", {"eps": -1e-8}, "eps", False),
    ("training", "global-batch-0", {"global_batch": 0}, "global_batch", False),
    ("training", "global-batch-1e15", {"global_batch": 10**15}, "global_batch", True),
    ("training", "micro-batch-0", {"micro_batch": 0}, "micro_batch", False),
    ("training", "zero-stage-5", {"zero_stage": 5}, "zero_stage", False),
    ("training", "recompute-unknown", {"recompute": "sometimes"}, "recompute", False),
    ("training", "grad-clip-inf", {"grad_clip": Raw(".inf")}, "grad_clip", False),
    ("training", "bucket-mb-nan", {"bucket_mb": Raw(".nan")}, "bucket_mb", False),
    ("training", "min-lr-inf", {"min_lr": Raw(".inf")}, "min_lr", False),
    ("training", "weight-decay-nan", {"weight_decay": Raw(".nan")}, "weight_decay", False),
    ("training", "steps-0", {"steps": 0}, "steps", False),
    ("training", "tokens-without-path", {"data": {"kind": "tokens"}}, "data", False),
    ("training", "typo", {"lr_max": 1}, "lr_max", False),
]

PLAN_OPTIONS: list[tuple[str, list[str], str]] = [
    ("top-0", ["--top", "0"], "--top"),
    ("top-negative", ["--top", "-1"], "--top"),
    ("tp-0", ["--tp", "0"], "tp"),
    ("tp-negative", ["--tp", "-2"], "tp"),
    ("tp-1e6", ["--tp", "1000000"], "tp"),
    ("pp-0", ["--pp", "0"], "pp"),
    ("vpp-0", ["--vpp", "0"], "vpp"),
    ("micro-batch-0", ["--micro-batch", "0"], "micro_batch"),
    ("zero-3", ["--zero", "3"], "zero"),
    ("zero-negative", ["--zero", "-1"], "zero"),
    ("recompute-unknown", ["--recompute", "bogus"], "recompute"),
    ("dp-reduce-unknown", ["--dp-reduce", "bogus"], "dp_reduce"),
    ("failure-rate-negative", ["--failure-rate", "-1"], "--failure-rate"),
    ("failure-rate-nan", ["--failure-rate", "nan"], "--failure-rate"),
    ("restart-s-inf", ["--restart-s", "inf"], "--restart-s"),
    ("ckpt-write-gbps-0", ["--ckpt-write-gbps", "0"], "--ckpt-write-gbps"),
    ("ckpt-write-gbps-nan", ["--ckpt-write-gbps", "nan"], "--ckpt-write-gbps"),
    ("keep-given-alone", ["--keep-given"], "--keep-given"),
    ("unknown-option", ["--bogus"], "--bogus"),
    ("unknown-option-json", ["--bogus", "--json"], "--bogus"),
]


def _output(target: Callable[[Workspace], str], *extra: str) -> Build:
    def build(ws: Workspace) -> list[str]:
        ws.put("README.md", "keep me\n")
        (ws.root / "adir").mkdir()
        return plan_argv(ws, "-o", ws.mark(target(ws)), *extra)
    return build


def plan_cases() -> Iterator[Case]:
    for slot in SLOTS:
        for how in FILE_KINDS:
            yield Case(f"plan-{slot}-{how}", _plan_file(slot, how), subprocess=how == "utf16")
    for how in FILE_KINDS:
        yield Case(f"plan-layout-{how}", lambda ws, how=how: plan_argv(
            ws, "--layout", ws.spoil(ws.base.plan8, "layout.yaml", how)))
    for slot, name, changes, field, isolate in PLAN_FIELDS:
        yield Case(f"plan-{slot}-{name}", _plan_field(slot, changes), field=field,
                   isolate=isolate)
    for name, changes, field in [("tp-3", {"tp": 3}, "tp"), ("tp-0", {"tp": 0}, "tp"),
                                 ("pp-negative", {"pp": -1}, "pp"),
                                 ("vpp-1e9", {"vpp": 10**9}, "vpp"),
                                 ("zero-7", {"zero_stage": 7}, "zero_stage")]:
        yield Case(f"plan-layout-{name}", lambda ws, changes=changes: plan_argv(
            ws, "--layout", ws.put("layout.yaml", _layout_text(changes))), field=field,
            isolate="1e" in name)
    yield Case("plan-layout-alias-bomb", lambda ws: plan_argv(
        ws, "--layout", ws.put("layout.yaml", with_estimate_bomb(ws.base.plan8.read_text()))),
        isolate=True)
    for name, args, field in PLAN_OPTIONS:
        yield Case(f"plan-option-{name}", lambda ws, args=args: plan_argv(ws, *args), field=field,
                   isolate="1e" in name)
    yield Case("plan-o-under-a-file", _output(lambda ws: "README.md/plan.yaml"), field="-o",
               subprocess=True)
    yield Case("plan-o-a-directory", _output(lambda ws: "adir"), field="-o")
    yield Case("plan-o-foo", _output(lambda ws: "foo://x/plan.yaml"), subprocess=True)
    yield Case("plan-o-foo-json", _output(lambda ws: "foo://x/plan.yaml", "--json"))
    yield Case("plan-o-under-a-file-json", _output(lambda ws: "README.md/plan.yaml", "--json"))


def _layout_text(changes: dict) -> str:
    import yaml

    return yaml.safe_dump({**yaml.safe_load(GOOD_LAYOUT), **changes})


def with_estimate_bomb(plan_text: str) -> str:
    """A plan whose ``estimate:`` section is a billion-laughs alias bomb."""
    return plan_text + "estimate:\n" + "".join(f"  {line}\n" for line in ALIAS_BOMB.splitlines())


# -- train ------------------------------------------------------------------------------------


def train_argv(ws: Workspace, plan: str | None = None, *extra: str, local: str = "8") -> list[str]:
    """In-process train cases always pass --local: the workers, never started, would be
    separate processes (test_fuzz.py refuses to start any)."""
    return ["train", plan or str(ws.base.plan8), "--run-dir", str(ws.root / "run"),
            "--local", local, *extra]


def _train_plan(changes: dict) -> Build:
    return lambda ws: train_argv(ws, ws.variant(ws.base.plan8, "plan.yaml", changes))


TRAIN_FIELDS: list[tuple[str, dict, str, bool]] = [
    ("cluster-nodes-1e12", {"cluster.hostlist": DELETE, "cluster.nodes": 10**12},
     "cluster.nodes", True),
    ("cluster-nic-inf", {"cluster.nic_gbit_per_s": Raw(".inf")}, "cluster.nic_gbit_per_s", False),
    ("model-layers-true", {"model.layers": True}, "model.layers", False),
    ("model-layers-1e9", {"model.layers": 10**9}, "model.layers", True),
    ("model-hidden-wide", {"model.hidden": "wide"}, "model.hidden", False),
    ("training-lr-inf", {"training.lr": Raw(".inf")}, "training.lr", False),
    ("training-beta1-nan", {"training.beta1": Raw(".nan")}, "training.beta1", False),
    ("training-beta2-negative", {"training.beta2": -1}, "training.beta2", False),
    ("training-steps-0", {"training.steps": 0}, "training.steps", False),
    ("layout-tp-3", {"layout.tp": 3}, "layout.tp", False),
    ("layout-dp-0", {"layout.dp": 0}, "layout.dp", False),
    ("layout-dp-3", {"layout.dp": 3}, "layout", False),
    ("placement-garbage", {"placement": {"ranks": "x"}}, "placement", False),
]

TRAIN_OPTIONS: list[tuple[str, list[str], str]] = [
    ("timeout-0", ["--timeout", "0"], "--timeout"),
    ("timeout-negative", ["--timeout", "-5"], "--timeout"),
    ("timeout-nan", ["--timeout", "nan"], "--timeout"),
    ("steps-0", ["--steps", "0"], "--steps"),
    ("steps-negative", ["--steps", "-5"], "--steps"),
    ("log-interval-0", ["--log-interval", "0"], "--log-interval"),
    ("ckpt-keep-0", ["--ckpt-keep", "0"], "--ckpt-keep"),
    ("zstd-level-99", ["--zstd-level", "99"], "--zstd-level"),
    ("unknown-option-json", ["--bogus", "--json"], "--bogus"),
]


def _tokens(how: str, data: bytes = b"", dtype: str = "uint16") -> Build:
    """A plan whose training data is a token file: ``how`` is ``bytes`` (``data`` written), or a
    `Workspace.spoil` kind (missing, dir, fifo, foo)."""
    def build(ws: Workspace) -> list[str]:
        path = ws.put("tokens.bin", data) if how == "bytes" else ws.spoil(ws.root, "tokens.bin", how)
        plan = ws.variant(ws.base.plan8, "plan.yaml", {"training.data": {
            "kind": "tokens", "path": path, "dtype": dtype}})
        ws.mark(path)
        return train_argv(ws, plan)
    return build


def _dataset(spoil: str) -> Build:
    """A plan whose training data is a Megatron-style indexed dataset, spoiled: ``weight-0`` (a
    blend weight of 0), ``idx-truncated`` (the index cut short), ``manifest-shard-missing`` (a
    prepared folder whose manifest names a shard that is gone)."""
    def build(ws: Workspace) -> list[str]:
        import json

        import numpy as np

        from mscale.data.indexed import IndexedWriter

        folder = ws.root / "tokens"
        folder.mkdir(parents=True, exist_ok=True)
        with IndexedWriter(str(folder / "shard-00000"), np.uint16) as w:
            for i in range(20):
                w.add_document(np.arange(100) % 200)
            info = w.close()
        source = {"path": str(folder / "shard-00000"), "weight": 1.0}
        bad = None  # the plan itself, for a bad weight
        if spoil == "weight-0":
            source["weight"] = 0
        elif spoil == "idx-truncated":
            bad = folder / "shard-00000.idx"
            bad.write_bytes(bad.read_bytes()[:-8])
        else:  # manifest-shard-missing
            manifest = {"format": "mscale-tokens", "version": 1, "tokenizer": "t.json",
                        "vocab_size": 256, "eod_id": 0, "dtype": "uint16",
                        "tokens": 2 * info["tokens"], "documents": 2 * info["documents"],
                        "shards": [{**info, "prefix": "shard-00000"},
                                   {**info, "prefix": "shard-00001"}]}
            (folder / "manifest.json").write_text(json.dumps(manifest))
            source["path"] = str(folder)
            bad = folder / "shard-00001.bin"
        plan = ws.variant(ws.base.plan8, "plan.yaml", {"training.data": {"sources": [source]}})
        if bad is not None:
            ws.mark(bad)
        return train_argv(ws, plan)
    return build


def _run_dir(make: Callable[[Workspace], str]) -> Build:
    def build(ws: Workspace) -> list[str]:
        argv = train_argv(ws)
        argv[argv.index("--run-dir") + 1] = ws.mark(make(ws))
        return argv
    return build


def _latest(text: bytes) -> Build:
    def build(ws: Workspace) -> list[str]:
        ws.run_copy()
        ws.put("run/ckpt/latest", text)
        return train_argv(ws, str(ws.base.plan2), local="2")
    return build


def train_cases() -> Iterator[Case]:
    for how in FILE_KINDS:
        yield Case(f"train-plan-{how}", lambda ws, how=how: train_argv(
            ws, ws.spoil(ws.base.plan8, "plan.yaml", how)), subprocess=how == "binary")
    yield Case("train-plan-alias-bomb", lambda ws: train_argv(
        ws, ws.put("plan.yaml", with_estimate_bomb(ws.base.plan2.read_text())), local="2"),
        isolate=True)
    for name, changes, field, isolate in TRAIN_FIELDS:
        yield Case(f"train-plan-{name}", _train_plan(changes), field=field, isolate=isolate)
    for name, args, field in TRAIN_OPTIONS:
        yield Case(f"train-option-{name}", lambda ws, args=args: train_argv(ws, None, *args),
                   field=field)
    yield Case("train-local-mismatch", lambda ws: train_argv(ws, local="2"), field="layout")
    yield Case("train-local-negative", lambda ws: train_argv(ws, local="-1"), field="--local")
    width = "training.data"
    yield Case("train-tokens-odd-size", _tokens("bytes", b"\x01\x00" * 500 + b"\x01"),
               field=width, subprocess=True)
    yield Case("train-tokens-odd-size-uint32", _tokens("bytes", b"\x01\x00" * 501, "uint32"),
               field=width)
    for how in ("missing", "dir", "fifo", "foo"):
        yield Case(f"train-tokens-{how}", _tokens(how), field=width)
    yield Case("train-data-weight-0", _dataset("weight-0"), field="training.data.sources")
    yield Case("train-data-idx-truncated", _dataset("idx-truncated"), field="idx.sequence_count")
    yield Case("train-data-manifest-shard-missing", _dataset("manifest-shard-missing"))
    yield Case("train-run-dir-a-file", _run_dir(lambda ws: ws.put("runfile", "keep\n")),
               field="--run-dir")
    yield Case("train-run-dir-under-a-file", _run_dir(
        lambda ws: ws.put("runfile", "keep\n") + "/run"), field="--run-dir")
    yield Case("train-run-dir-foo", _run_dir(lambda ws: "foo://x/run"))
    yield Case("train-resume-foo", lambda ws: train_argv(ws, None, "--resume",
                                                         ws.mark("foo://x/ckpt")))
    yield Case("train-resume-missing", lambda ws: train_argv(
        ws, None, "--resume", ws.mark(ws.root / "nowhere")))
    yield Case("train-resume-binary-file", lambda ws: train_argv(
        ws, None, "--resume", ws.put("resume.bin", BAD_TEXT["binary"](""))))
    yield Case("train-resume-damaged-manifest", lambda ws: train_argv(
        ws, None, "--resume", str(_damage_manifest(ws))), code=(2, 3))
    yield Case("train-latest-outside", _latest(b"../../../etc\n"))
    yield Case("train-latest-binary", _latest(BAD_TEXT["binary"]("")))


def _damage_manifest(ws: Workspace):
    ck = ws.ckpt_copy()
    ws.put(str((ck / "manifest.json").relative_to(ws.root)), BAD_TEXT["binary"](""))
    return ck
