"""bench_data.py's report: the tables it prints of each section's figures (``--json`` prints
the figures themselves instead).
"""

from __future__ import annotations

from bench_data_prepare import VOCAB


def report(res: dict) -> None:
    if "prepare" in res:
        report_prepare(res["prepare"])
    if "loader" in res:
        report_loader(res)
    if "remote" in res:
        report_remote(res["remote"])


def report_prepare(p: dict) -> None:
    print(f"\n1. prepare: {p['files']} files, {p['text_bytes'] / 1e6:.1f} MB of .py, "
          f"{p['tokens']:,} tokens ({p['text_bytes'] / p['tokens']:.2f} bytes a token), "
          f"BPE {VOCAB} trained in {p['tokenizer_train_s']:.1f} s; median of {p['rounds']} "
          f"(min-max)")
    print(f"   {'what':<34} {'seconds':>20} {'tokens/s':>10} {'per worker':>11} "
          f"{'/ ref':>6} {'1st batch':>9} {'CPU s':>6} {'of it here':>10} {'tok/CPU-s':>10} "
          f"{'/ ref1':>7}")
    for key, what in (("ref1", "reference: encode_batch, 1 thread"),
                      ("w1", "prepare, workers=1"),
                      ("ref2", "reference: encode_batch, 2 threads"),
                      ("w2", "prepare, workers=2")):
        r = p[key]
        secs = f"{r['s']:.2f} ({r['s_min']:.2f}-{r['s_max']:.2f})"
        per = f"{r['tok_s_per_worker']:,}" if "tok_s_per_worker" in r else ""
        ratio = f"{r['ratio_to_ref']:.2f}" if "ratio_to_ref" in r else ""
        first = f"{r['first_batch_s']:.2f}s" if "first_batch_s" in r else ""
        cratio = f"{r['cpu_ratio_to_ref']:.2f}" if "cpu_ratio_to_ref" in r else ""
        print(f"   {what:<34} {secs:>20} {r['tok_s']:>10,} {per:>11} {ratio:>6} {first:>9} "
              f"{r['cpu_s']:>6.2f} {r['cpu_here_s']:>10.2f} {r['tok_per_cpu_s']:>10,} "
              f"{cratio:>7}")
    print("   / ref: wall-time ratio to the reference with as many threads as workers; CPU s: "
          "this process and its children (workers, forkserver); / ref1: CPU ratio to 1 thread")


def report_loader(res: dict) -> None:
    print("\n2. loader: DatasetTokens.batch, 2 sources 3:1, shuffled, eval_fraction 0.01; "
          "floor: np.memmap slices")
    print(f"   {'shape':<30} {'tokens/s':>11} {'floor':>12} {'/ floor':>8} {'us/mb':>8} "
          f"{'floor us/mb':>11} {'index us/mb':>11} {'step needs':>11} {'headroom':>9}")
    for name, s in res["shapes"].items():
        lo = res["loader"][name]
        label = f"{name} seq {s['seq_len']} x mb {s['micro_batch']}"
        print(f"   {label:<30} {lo['tok_s']:>11,} {lo['floor_tok_s']:>12,} "
              f"{lo['ratio_to_floor']:>8.3f} {lo['us_per_micro_batch']:>8.1f} "
              f"{lo['floor_us_per_micro_batch']:>11.1f} {lo['index_us_per_micro_batch']:>11.1f} "
              f"{s['needed_tok_s']:>11,} {lo['headroom_vs_step']:>8}x")
    for name, s in res["shapes"].items():
        print(f"   {name}: {s['global_batch']} x {s['seq_len']} tokens per {s['step_s']} s step "
              f"({s['plan']})")
    print("   index: Mixture.locate alone (blend + Feistel shuffle) for the same micro-batches; "
          "headroom: tokens/s / what the step needs")


def report_remote(r: dict) -> None:
    print(f"\n3. remote: slowmem:// ({r['latency_ms']} ms a range read), blocks "
          f"{r['block_mib']:g} MiB, {r['cache_mib']:g} MiB cached per process; {r['shape']} shape "
          f"(seq {r['seq_len']} x mb {r['micro_batch']}), fake step {r['step_s']} s over "
          f"{r['micro_batches']} micro-batches")
    print(f"   {'source (.bin per source)':<31} {'read_ahead':>10} {'wait share':>11} "
          f"{'wait/step':>10} {'max':>7} {'of it CPU':>10} {'step':>7} {'step 0 wait':>12} "
          f"{'reads/sample':>13} {'fetch/step':>11}")
    for name, rows in r["cases"].items():
        label = {"local": "local files (memmap, no latency)",
                 "stdlib": f"slowmem, stdlib ({r['small_bin_mib']} MiB)",
                 "big": f"slowmem, repeated ({r.get('big_bin_mib')} MiB)"}[name]
        for row in rows:
            print(f"   {label:<31} {row['read_ahead']:>10} {row['wait_share']:>11.1%} "
                  f"{row['wait_ms_per_step']:>8.1f}ms {row['max_wait_ms']:>5.0f}ms "
                  f"{row['get_cpu_ms_per_step']:>8.1f}ms "
                  f"{row['step_ms']:>5.0f}ms {row['first_step_wait_ms']:>10.1f}ms "
                  f"{row['range_reads_per_sample']:>13.3f} {row['fetch_ms_per_step']:>9.1f}ms")
    print("   wait share: time in loader.get / wall time of the timed steps (step 0 apart); "
          "wait/step: median, max: the worst step;\n   of it CPU: the training thread's CPU "
          "time in loader.get; fetch/step: seconds of range reads per step's samples")
    print("   goal: wait share < 5% with read-ahead")
