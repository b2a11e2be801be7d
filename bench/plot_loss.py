"""Draw a run's training and held-out loss curves as an SVG (the README's real-text demo figure).

    .venv/bin/python bench/plot_loss.py runs/demo-text docs/img/demo-text-loss.svg \
        --entropy 5.971

Reads RUN/metrics.jsonl, and the held-out loss before the first step from RUN/events.jsonl
(the ``info`` event with ``evidence.eval_loss`` at step 0; ``--start`` overrides it, for a run
directory written before train recorded it).
"""

from __future__ import annotations

import argparse
import json
from pathlib import Path


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("run", help="run directory")
    ap.add_argument("out", help="SVG file to write")
    ap.add_argument("--entropy", type=float, help="draw the corpus's unigram entropy (nats)")
    ap.add_argument("--start", type=float, help="held-out loss before training (step 0); "
                    "default: the one train recorded in events.jsonl")
    args = ap.parse_args()
    import matplotlib

    matplotlib.use("Agg")
    from matplotlib.figure import Figure

    # a resumed attempt records again the steps after its checkpoint: the newest record of each
    # step is the one the run kept
    by_step = {}
    for line in Path(args.run, "metrics.jsonl").read_text().splitlines():
        if line.strip():
            r = json.loads(line)
            by_step[r["step"]] = r
    records = [by_step[s] for s in sorted(by_step)]
    steps = [r["step"] for r in records]
    held = [(r["step"], r["eval_loss"]) for r in records if "eval_loss" in r]
    start = args.start if args.start is not None else _start(Path(args.run, "events.jsonl"))
    if start is not None:
        held.insert(0, (0, start))
    fig = Figure(figsize=(6.4, 3.2))
    ax = fig.subplots()
    ax.plot(steps, [r["loss"] for r in records], lw=1, alpha=0.6, label="training loss")
    ax.plot(*zip(*held), "o-", ms=4, lw=1.5, label="held-out loss")
    if args.entropy is not None:
        ax.axhline(args.entropy, ls="--", lw=1, color="grey",
                   label=f"unigram entropy {args.entropy:.3f}")
    ax.set_xlabel("step")
    ax.set_ylabel("nats / token")
    ax.grid(alpha=0.3)
    ax.legend(fontsize=8)
    Path(args.out).parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(args.out, format="svg", bbox_inches="tight", metadata={"Date": None})
    print(f"wrote {args.out}: {len(steps)} steps, {len(held)} held-out points")


def _start(events: Path) -> float | None:
    """The newest held-out loss train recorded before its first step, if any."""
    if not events.exists():
        return None
    found = None
    for line in events.read_text().splitlines():
        e = json.loads(line) if line.strip() else {}
        evidence = e.get("evidence") or {}
        if e.get("source") == "train" and e.get("step") == 0 and "eval_loss" in evidence:
            found = evidence["eval_loss"]
    return found


if __name__ == "__main__":
    main()
