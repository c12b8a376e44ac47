"""PipeDream-2BW against the flushing schedules: step time and memory at p = 2 ranks.

    python benchmarks/twobw.py [--ms 4 8 16] [--steps 13] [--rounds 3]

The design card's GPT through ``Trainer(strategy=PipelineStrategy(schedule=...))`` for 2bw, 1f1b and gpipe at
each micro-batch count; each round runs every pair, in another order each round; medians over the rounds' steps
after warm-up. 1F1B's bubble is (p-1)/(m+p-1) of a step, which 2BW fills with the next batch's forwards (the
ceiling at p=2, m=8 is 9/8 of 1F1B's throughput). Memory: each rank's peak resident growth during ``fit``
(2BW keeps a second copy of each stage's weights). Writes benchmarks/results/twobw.json and the timeline of two
consecutive 2BW steps, benchmarks/results/schedule_2bw_two_steps.png.
"""

from __future__ import annotations

import argparse
import json
import statistics
from pathlib import Path

from common import launch, machine, median_spread, step_times

HERE = Path(__file__).parent
SCHEDULES = ("2bw", "1f1b", "gpipe")


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--ms", type=int, nargs="+", default=[4, 8, 16])
    parser.add_argument("--steps", type=int, default=13)
    parser.add_argument("--rounds", type=int, default=3)
    args = parser.parse_args()
    runs = [(name, m) for m in args.ms for name in SCHEDULES]
    steps: dict[tuple[str, int], list[float]] = {run: [] for run in runs}
    peaks: dict[tuple[str, int], list[list[float]]] = {run: [] for run in runs}
    for round_ in range(args.rounds):
        shift = round_ % len(SCHEDULES)  # each schedule first, middle and last in turn
        order = [(name, m) for m in args.ms for name in SCHEDULES[shift:] + SCHEDULES[:shift]]
        for name, m in order:
            result = launch("run_strategy.py", name, m, args.steps)
            steps[name, m] += step_times(result["ends"])
            peaks[name, m].append(result["peak_mib"])
            print(name, m, statistics.median(steps[name, m]), flush=True)
    rows = []
    for name, m in runs:
        median = statistics.median(steps[name, m])
        flushing = statistics.median(steps["1f1b", m])
        rows.append({"schedule": name, "n_microbatches": m, "step_s": median_spread(steps[name, m]),
                     "throughput_over_1f1b": flushing / median,
                     "peak_mib_per_rank": [max(p[r] for p in peaks[name, m]) for r in range(2)]})  # fmt: skip
    timeline = HERE / "results" / "schedule_2bw_two_steps.png"
    launch("run_strategy.py", "2bw", 4, 6, extra=json.dumps({"timeline": str(timeline)}))
    result = {"benchmark": "twobw", "machine": machine(), "config": vars(args), "rows": rows}
    (HERE / "results" / "twobw.json").write_text(json.dumps(result, indent=1))
    print("| m | schedule | step (median, spread) | throughput / 1F1B | peak MiB rank 0, rank 1 |")
    print("| --- | --- | --- | --- | --- |")
    for row in rows:
        s = row["step_s"]
        peak = ", ".join(f"{p:.0f}" for p in row["peak_mib_per_rank"])
        print(
            f"| {row['n_microbatches']} | {row['schedule']} | {s['median']:.3f} s ({s['min']:.3f}-{s['max']:.3f}) |"
            f" {row['throughput_over_1f1b']:.3f} | {peak} |"
        )


if __name__ == "__main__":
    main()
