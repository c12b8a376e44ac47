"""What activation checkpointing costs each kind of schedule: step time with and without, p = 2 ranks.

    python benchmarks/recompute.py [--m 4] [--steps 9] [--rounds 3]

The design card's GPT (8 layers; 1F1B holds one stage per rank, the zero-bubble and V schedules
two). Recomputation should cost about one extra forward whatever the schedule; torch's checkpoint
recomputed each layer once per backward pass, and the zero-bubble and V schedules run an input and
a weight pass per micro-batch (lightning_pp.memory.recompute recomputes once). Each round runs every
(schedule, recompute) pair, in another order each round; medians over the rounds' steps. Writes
benchmarks/results/recompute.json.
"""

from __future__ import annotations

import argparse
import json
import statistics
from pathlib import Path

from common import launch, machine, median_spread, step_times

HERE = Path(__file__).parent
SCHEDULES = ("1f1b", "interleaved_zb", "zbv")


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--m", type=int, default=4)
    parser.add_argument("--steps", type=int, default=9)
    parser.add_argument("--rounds", type=int, default=3)
    args = parser.parse_args()
    runs = [(name, recompute) for name in SCHEDULES for recompute in (False, True)]
    steps: dict[tuple[str, bool], list[float]] = {run: [] for run in runs}
    for round_ in range(args.rounds):
        for name, recompute in runs[round_ % len(runs) :] + runs[: round_ % len(runs)]:
            options = json.dumps({"activation_checkpointing": recompute})
            steps[name, recompute] += step_times(
                launch("run_strategy.py", name, args.m, args.steps, extra=options)["ends"]
            )
            print(name, recompute, statistics.median(steps[name, recompute]), flush=True)
    ratio = {name: statistics.median(steps[name, True]) / statistics.median(steps[name, False]) for name in SCHEDULES}
    result = {
        "benchmark": "recompute",
        "machine": machine(),
        "config": {"ranks": 2, "n_microbatches": args.m, "steps": args.steps, "rounds": args.rounds},
        "rows": [
            {"schedule": name, "activation_checkpointing": recompute, "step_s": median_spread(steps[name, recompute])}
            for name, recompute in runs
        ],
        "ratio_with_over_without": ratio,
        "ratio_over_1f1b_ratio": {name: ratio[name] / ratio["1f1b"] for name in SCHEDULES},
    }
    (HERE / "results" / "recompute.json").write_text(json.dumps(result, indent=1))
    print(json.dumps(result["ratio_with_over_without"]), json.dumps(result["ratio_over_1f1b_ratio"]))


if __name__ == "__main__":
    main()
