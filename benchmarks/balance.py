"""A heavy vocabulary head: step time under each balance mode (1F1B, p = 2, m = 8).

    python benchmarks/balance.py [--vocab 16000] [--rounds 3] [--steps 9]

The design card's GPT with a large vocabulary, whose head and loss outweigh several layers but
hold few parameters per unit of work. "uniform" splits the layers 4/4, "parameters" counts
parameters, "profile" times every layer on the first batch and splits min-max. Runs alternate
over the modes; medians. Writes benchmarks/results/balance.json.
"""

from __future__ import annotations

import argparse
import json
import statistics
from pathlib import Path

from common import MODEL, launch, machine, median_spread, step_times

HERE = Path(__file__).parent
MODES = ("uniform", "parameters", "profile")


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--vocab", type=int, default=16000)
    parser.add_argument("--m", type=int, default=8)
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--steps", type=int, default=9)
    args = parser.parse_args()
    runs: dict[str, list[float]] = {mode: [] for mode in MODES}
    splits: dict[str, list[int]] = {}
    for _ in range(args.rounds):
        for mode in MODES:
            options = json.dumps({"balance": mode, "vocab": args.vocab})
            run = launch("run_strategy.py", "1f1b", args.m, args.steps, extra=options)
            runs[mode].append(statistics.median(step_times(run["ends"])))
            splits[mode] = run["layers_per_stage"]
            print(mode, splits[mode], runs[mode][-1], flush=True)
    result = {
        "benchmark": "balance",
        "machine": machine(),
        "config": {"model": {**MODEL, "vocab": args.vocab}, "schedule": "1f1b", "ranks": 2, "n_microbatches": args.m,
                   "steps": args.steps, "rounds": args.rounds},
        "rows": [{"balance": mode, "layers_per_stage": splits[mode], "step_s": median_spread(runs[mode])}
                 for mode in MODES],
        "speedup_profile_over_uniform": statistics.median(runs["uniform"]) / statistics.median(runs["profile"]),
    }  # fmt: skip
    (HERE / "results" / "balance.json").write_text(json.dumps(result, indent=1))
    print(json.dumps(result, indent=1))


if __name__ == "__main__":
    main()
