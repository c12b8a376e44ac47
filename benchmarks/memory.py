"""Peak activation memory saved for backward per rank: GPipe against 1F1B, interleaved 1F1B and ZBV (p=2, m=8;
two stages per rank for the last two), and 1F1B with activation checkpointing against without.

    python benchmarks/memory.py [--m 8] [--steps 3]

Measured through the Trainer and the strategy with saved-tensor hooks (each storage counted once,
parameters excluded). Writes benchmarks/results/memory.json.
"""

from __future__ import annotations

import argparse
import json
from pathlib import Path

from common import BATCH, MODEL, launch, machine

HERE = Path(__file__).parent


def peaks(schedule: str, m: int, steps: int, recompute: bool = False) -> dict[str, list[int]]:
    return launch("run_memory.py", schedule, m, steps, extra="recompute" if recompute else None)


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--m", type=int, default=8)
    parser.add_argument("--steps", type=int, default=3)
    args = parser.parse_args()
    runs = {name: peaks(name, args.m, args.steps) for name in ("gpipe", "1f1b", "interleaved_1f1b", "zbv")}
    runs["1f1b_activation_checkpointing"] = peaks("1f1b", args.m, args.steps, recompute=True)
    gpipe, one_f_one_b, recomputed = (
        runs[k]["peak_bytes_per_stage"] for k in ("gpipe", "1f1b", "1f1b_activation_checkpointing")
    )
    result = {
        "benchmark": "memory",
        "machine": machine(),
        "config": {"model": MODEL, "batch": BATCH, "stages": 2, "n_microbatches": args.m, "steps": args.steps},
        "peak_saved_bytes": {name: run["peak_bytes_per_stage"] for name, run in runs.items()},
        "held_from_earlier_steps_bytes": {name: run["held_bytes_per_stage"] for name, run in runs.items()},
        "ratio_1f1b_over_gpipe": max(one_f_one_b) / max(gpipe),
        "ratio_per_stage": [b / a for a, b in zip(gpipe, one_f_one_b)],
        "ratio_checkpointed_over_1f1b_per_stage": [b / a for a, b in zip(one_f_one_b, recomputed)],
    }
    path = HERE / "results" / "memory.json"
    path.write_text(json.dumps(result, indent=1))
    print(json.dumps(result, indent=1))


if __name__ == "__main__":
    main()
