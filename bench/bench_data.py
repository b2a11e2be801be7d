"""Benchmark: the data path, from text to the micro-batches a step reads.

Prints figures (not a test; no pass/fail); docs/benchmarks.md "Data path" keeps the last run's.
Each figure has its reference measured in the same process:

1. prepare: `mscale.data.prepare.prepare` on the Python standard library's top-level ``.py``
   files with a 1,024-id byte-level BPE trained on them (`train_tokenizer`), ``workers`` 1 and 2,
   tokens/s in all and per worker process; reference: the `tokenizers` library's own
   ``encode_batch`` on the same texts (read beforehand), one thread and two. The ratio is what
   reading, batching, worker processes and writing the shards cost on top of the tokenizer.
2. loader: `DatasetTokens.batch` (`mscale.data.blend.build_splits`: two sources blended 3:1,
   shuffled, ``eval_fraction`` 0.01) for micro-batches shaped like the real-text demo's
   (``plans/cpu-text.yaml``) and like the 1B-on-one-H200 run's (``plans/gpu-1b-h200.yaml``),
   tokens/s; reference (the floor): ``np.memmap`` slicing of as many samples, at random sample
   starts, from one flat token file. Against what a step consumes: the demo's global batch per
   ``--demo-step-s``, the 1B run's per ``--gpu-step-s`` (docs/benchmarks.md, "GPU").
3. remote: the same sources served by ``slowmem://``, fsspec's in-memory filesystem with
   ``--latency-ms`` slept in every ``cat_file`` (every range read `storage.RemoteBlob` makes),
   read by `DataLoader` while a fake step sleeps ``--step-s`` over its micro-batches: the share
   of the step spent waiting in ``loader.get``, ``read_ahead`` 0 (the reference) against 2.
   Also from the local files (no latency: what reading itself costs the step), and from a
   source larger than `RemoteBlob`'s block cache (``--big-mib`` per source: the same tokens
   repeated), where shuffled samples rarely share a 4 MiB block, as on any real corpus.
   Demo-shaped micro-batches and a 0.2 s step by default; ``--remote-shape 1B`` for the 1B
   run's, with its step.

    .venv/bin/python bench/bench_data.py                  # ~2 min on 2 shared cores
    .venv/bin/python bench/bench_data.py --sections remote --remote-shape 1B --steps 6
    .venv/bin/python bench/bench_data.py --rounds 1 --json
"""

from __future__ import annotations

import argparse
import json
import os
import shlex
import shutil
import sys
import sysconfig
import tempfile
import time
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO / "src"))
sys.path.insert(0, str(Path(__file__).resolve().parent))  # the sections' sibling modules

from bench_data_loader import bench_loader, shapes  # noqa: E402
from bench_data_prepare import VOCAB, bench_prepare  # noqa: E402
from bench_data_remote import bench_remote  # noqa: E402
from bench_data_report import report  # noqa: E402
from mscale.data.prepare import prepare  # noqa: E402
from mscale.data.tokenizer import train_tokenizer  # noqa: E402

# Each section is a module beside this one (bench_data_prepare, _loader, _remote; the tables:
# bench_data_report). torch (mscale.train.data) and pydantic (mscale.config) are imported where
# they are used: prepare's worker processes start by importing this __main__ module, and so the
# section modules, as spawn and forkserver children do, and the CLI's __main__ imports neither.


def command() -> str:
    exe = Path(sys.executable)
    shown = os.path.relpath(exe, Path.cwd()) if exe.is_relative_to(Path.cwd()) else str(exe)
    return shlex.join([shown, *sys.argv])


def machine() -> dict:
    try:
        cores = len(os.sched_getaffinity(0))
    except AttributeError:
        cores = os.cpu_count() or 1
    return {"cores": cores, "load": [round(x, 2) for x in os.getloadavg()]}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--rounds", type=int, default=2, help="rounds of 1 and 2 (medians)")
    ap.add_argument("--loader-tokens", type=int, default=500_000,
                    help="tokens per loader round and shape")
    ap.add_argument("--demo-seq", type=int, help="seq_len of the demo shape (default: its plan's)")
    ap.add_argument("--demo-micro", type=int,
                    help="micro_batch of the demo shape (default: its plan's)")
    ap.add_argument("--demo-step-s", type=float, default=0.4,
                    help="the real-text demo's step on these CPUs, measured when it was 16 x 128 "
                         "tokens (plans/cpu-text.yaml now has seq_len 64)")
    ap.add_argument("--gpu-step-s", type=float, default=0.716,
                    help="the 1B run's step on one H200 (docs/benchmarks.md, GPU)")
    ap.add_argument("--latency-ms", type=float, default=20.0, help="slept per range read")
    ap.add_argument("--remote-shape", choices=("demo", "1B"), default="demo",
                    help="micro-batches of section 3")
    ap.add_argument("--step-s", type=float,
                    help="fake step of section 3 (default 0.2 s, or --gpu-step-s for 1B)")
    ap.add_argument("--steps", type=int, default=10, help="timed fake steps per case")
    ap.add_argument("--big-mib", type=int, default=128,
                    help="the larger-than-cache source of section 3 (0: skip)")
    ap.add_argument("--sections", default="prepare,loader,remote",
                    help="which of prepare,loader,remote to run (comma-separated)")
    ap.add_argument("--json", action="store_true", help="print the figures as JSON only")
    args = ap.parse_args()

    res = {"command": command(), "machine_start": machine()}
    if not args.json:
        print(f"command: {res['command']}")
        print(f"machine: {res['machine_start']['cores']} cores, load average "
              f"{' '.join(map(str, res['machine_start']['load']))}", flush=True)
    t0 = time.perf_counter()
    sections = set(args.sections.split(","))
    with tempfile.TemporaryDirectory(prefix="bench-data-") as tmp:
        if "prepare" in sections:
            res["prepare"] = bench_prepare(args, tmp)
        else:  # the sources the other sections read, untimed
            corpus = sysconfig.get_paths()["stdlib"] + "/*.py"
            train_tokenizer([corpus], VOCAB, f"{tmp}/tokenizer.json", text_exts=[".py"])
            prepare([corpus], f"{tmp}/tokenizer.json", f"{tmp}/tokens-w1", workers=1,
                    text_exts=[".py"])
            shutil.copytree(f"{tmp}/tokens-w1", f"{tmp}/tokens-w2")
        res["shapes"] = shapes(args)
        if "loader" in sections:
            res["loader"] = {name: bench_loader(args, tmp, s)
                             for name, s in res["shapes"].items()}
        if "remote" in sections:
            res["remote"] = bench_remote(args, tmp, res["shapes"][args.remote_shape])
    res["machine_end"] = machine()
    res["wall_s"] = round(time.perf_counter() - t0, 1)
    if args.json:
        print(json.dumps(res, indent=1))
        return
    report(res)
    print(f"\nwall {res['wall_s']} s; load average at the end "
          f"{' '.join(map(str, res['machine_end']['load']))}")


if __name__ == "__main__":
    main()
