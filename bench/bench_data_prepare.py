"""bench_data.py's section 1, prepare: `mscale.data.prepare.prepare` on the standard library's
``.py`` files against the `tokenizers` library's own ``encode_batch``, with the CPU time of
prepare's worker processes read from /proc. Apart from bench_data.py so that the script keeps its
argument parsing and the order of the sections; torch and pydantic stay out of this module's
imports (prepare's workers import bench_data.py, and so this module, as they start).
"""

from __future__ import annotations

import glob
import os
import statistics
import sysconfig
import time
from pathlib import Path

from mscale.data.prepare import prepare
from mscale.data.tokenizer import train_tokenizer

VOCAB = 1024
"""Ids of the byte-level BPE trained on the corpus (every section reads its tokens)."""


def median_range(xs: list[float]) -> tuple[float, float, float]:
    return statistics.median(xs), min(xs), max(xs)


def encode_reference(tok_json: str, texts: list[str], threads: int) -> tuple[float, float, int]:
    """Seconds, CPU seconds of this process and tokens (EOD included, as prepare counts) of one
    ``encode_batch`` over all texts, on ``threads`` threads (tokenizers' own pool; 1:
    TOKENIZERS_PARALLELISM=false)."""
    from tokenizers import Tokenizer

    tok = Tokenizer.from_str(tok_json)
    saved = os.environ.get("TOKENIZERS_PARALLELISM")
    os.environ["TOKENIZERS_PARALLELISM"] = "false" if threads == 1 else "true"
    try:
        t0, c0 = time.perf_counter(), time.process_time()
        encs = tok.encode_batch(texts, add_special_tokens=False)
        dt, cpu = time.perf_counter() - t0, time.process_time() - c0
    finally:
        if saved is None:
            os.environ.pop("TOKENIZERS_PARALLELISM", None)
        else:
            os.environ["TOKENIZERS_PARALLELISM"] = saved
    return dt, cpu, sum(len(e.ids) for e in encs) + len(texts)


def descendants_cpu() -> dict[int, float]:
    """CPU seconds (user + system) of every live descendant of this process, by pid, from
    /proc (Linux; {} elsewhere): prepare's worker processes are the forkserver's children, so
    this process's own rusage never sees them."""
    if not os.path.isdir("/proc/self"):
        return {}
    tick = os.sysconf("SC_CLK_TCK")
    parent, cpu = {}, {}
    for d in os.listdir("/proc"):
        if not d.isdigit():
            continue
        try:
            with open(f"/proc/{d}/stat") as f:
                stat = f.read()
        except OSError:
            continue
        rest = stat[stat.rindex(")") + 2:].split()  # state, ppid, ..., utime (11), stime (12)
        parent[int(d)], cpu[int(d)] = int(rest[1]), (int(rest[11]) + int(rest[12])) / tick
    me, out = os.getpid(), {}
    for pid in cpu:
        p = parent.get(pid, 0)
        while p > 1 and p != me:
            p = parent.get(p, 0)
        if p == me:
            out[pid] = cpu[pid]
    return out


def run_prepare(corpus: str, tokenizer: str, out: str, workers: int) -> dict:
    """One `prepare`: wall seconds, CPU seconds here and in the descendants (the workers, and
    the forkserver they are forked from), seconds until the first batch was written."""
    before = descendants_cpu()
    seen: dict[int, float] = {}
    t0, c0 = time.perf_counter(), time.process_time()
    first = []

    def progress(documents, tokens, nbytes, *_):  # and pending bytes: not timed here
        if not first:
            first.append(time.perf_counter() - t0)
        for pid, c in descendants_cpu().items():  # before the pool's workers exit
            seen[pid] = max(seen.get(pid, 0.0), c)

    m = prepare([corpus], tokenizer, out, workers=workers, text_exts=[".py"], force=True,
                progress=progress)
    wall, here = time.perf_counter() - t0, time.process_time() - c0
    for pid, c in descendants_cpu().items():
        seen[pid] = max(seen.get(pid, 0.0), c)
    there = sum(c - before.get(pid, 0.0) for pid, c in seen.items())
    return {"s": wall, "cpu_here": here, "cpu_workers": there, "first": first[0],
            "tokens": m["tokens"], "documents": m["documents"]}


def bench_prepare(args, tmp: str) -> dict:
    corpus = sysconfig.get_paths()["stdlib"] + "/*.py"
    files = sorted(glob.glob(corpus))
    t0 = time.perf_counter()
    tok = train_tokenizer([corpus], VOCAB, f"{tmp}/tokenizer.json", text_exts=[".py"])
    train_s = time.perf_counter() - t0
    texts = [t for t in (Path(f).read_text(encoding="utf-8") for f in files) if t]
    tok_json = Path(tok["out"]).read_text(encoding="utf-8")
    runs: dict[str, list[dict]] = {"ref1": [], "ref2": [], "w1": [], "w2": []}
    for r in range(args.rounds):  # alternated, so drift on shared cores hits all alike
        for threads in (1, 2):
            dt, cpu, n = encode_reference(tok_json, texts, threads)
            runs[f"ref{threads}"].append({"s": dt, "cpu_here": cpu, "cpu_workers": 0.0,
                                          "tokens": n})
        for workers in (1, 2):
            runs[f"w{workers}"].append(run_prepare(corpus, f"{tmp}/tokenizer.json",
                                                   f"{tmp}/tokens-w{workers}", workers))
    counts = {key: {r["tokens"] for r in rs} for key, rs in runs.items()}
    if len(set().union(*counts.values())) != 1:
        raise SystemExit(f"token counts differ between prepare and the reference: {counts}")
    n = runs["w1"][0]["tokens"]
    res = {"files": len(files), "documents": runs["w1"][0]["documents"],
           "text_bytes": tok["bytes"], "tokens": n, "tokenizer_train_s": round(train_s, 2),
           "rounds": args.rounds}
    for key, rs in runs.items():
        med, lo, hi = median_range([r["s"] for r in rs])
        cpu = statistics.median([r["cpu_here"] + r["cpu_workers"] for r in rs])
        res[key] = {"s": round(med, 3), "s_min": round(lo, 3), "s_max": round(hi, 3),
                    "tok_s": round(n / med), "cpu_s": round(cpu, 2),
                    "cpu_here_s": round(statistics.median([r["cpu_here"] for r in rs]), 2),
                    "tok_per_cpu_s": round(n / cpu)}
        if "first" in rs[0]:
            res[key]["first_batch_s"] = round(statistics.median([r["first"] for r in rs]), 2)
    for w in (1, 2):
        r = res[f"w{w}"]
        r["tok_s_per_worker"] = round(n / r["s"] / w)
        r["ratio_to_ref"] = round(res[f"ref{w}"]["s"] / r["s"], 3)
        r["cpu_ratio_to_ref"] = round(res["ref1"]["cpu_s"] / r["cpu_s"], 3)
    return res

