"""Does DeepSpeed's pipeline schedule cost more than 1F1B? A timing simulation.

MT-NLG (DeepSpeed's pipeline engine) ran ~20% slower than Megatron-LM on the same cluster and
layout (docs/plan.md, "Predictions against published measurements"). One candidate cause is the
schedule itself: DeepSpeed's ``TrainSchedule`` (deepspeed/runtime/pipe/schedule.py) runs
2·(m + p − 1) steps in which stage s does a forward when the step and s have the same parity and
a backward otherwise, and its sends and receives block until the neighbour posts the matching
call: a forward step exchanges with the previous stage, a backward step with the next.

This script simulates that schedule with compute times F (forward) and B (backward) per
micro-batch and stage, every exchange a rendezvous of the two stages (zero transfer time), and
compares the makespan with 1F1B's (m + p − 1)·(F + B). Result: equal for every case below, so
the schedule does not explain the gap.

    .venv/bin/python bench/deepspeed_schedule.py
"""

from __future__ import annotations


def micro_batch_at(step: int, stage: int, stages: int) -> tuple[int, bool]:
    """(micro-batch, is_forward) that ``stage`` works on at ``step`` of DeepSpeed's schedule."""
    if step % 2 == stage % 2:  # forward steps
        return (step - stage % 2) // 2 - stage // 2, True
    if step % 2 == 0:  # backward, even step, odd stage
        return step // 2 - stages + (stage + 1) // 2, False
    return (step - 1) // 2 - stages + 1 + stage // 2, False


def makespan(stages: int, micro: int, fwd: float, bwd: float) -> float:
    """Time until the last stage finishes its last step."""
    end = [0.0] * stages
    previous = [-1] * stages
    for step in range(2 * (micro + stages - 1)):
        work = [micro_batch_at(step, s, stages) for s in range(stages)]
        start = list(end)
        for s, (mb, forward) in enumerate(work):
            peer = s - 1 if forward else s + 1
            talks = 0 <= mb < micro or 0 <= previous[s] < micro
            if 0 <= peer < stages and talks:  # blocking exchange: both must be there
                start[s] = max(end[s], end[peer])
        for s, (mb, forward) in enumerate(work):
            end[s] = start[s] + ((fwd if forward else bwd) if 0 <= mb < micro else 0.0)
            previous[s] = mb
    return max(end)


def main() -> None:
    print("stages  micro  F:B   DeepSpeed / 1F1B makespan")
    for stages, micro in ((35, 240), (35, 192), (35, 160), (12, 384), (4, 8)):
        for fwd, bwd in ((1.0, 2.0), (1.0, 3.0)):  # 3: backward with the recomputed forward
            ours = (micro + stages - 1) * (fwd + bwd)
            ratio = makespan(stages, micro, fwd, bwd) / ours
            print(f"{stages:6d} {micro:6d}  1:{bwd:.0f}  {ratio:.4f}")


if __name__ == "__main__":
    main()
