"""Every schedule at the same m: measured step time and bubble (PipelineMonitor), p = 2 ranks.

    python benchmarks/schedules.py [--m 8] [--steps 9] [--rounds 1]

The design card's GPT; GPipe and 1F1B hold one stage per rank, the others two (loop or V
placement), so the 8 layers make 2 or 4 stages. The monitor's all-gather adds the same cost to
every schedule. Runs alternate over the schedules; medians. Writes benchmarks/results/schedules.json
and each schedule's last timeline as benchmarks/results/schedule_<name>.png (rows: pipeline ranks).
"""

from __future__ import annotations

import argparse
import json
import shutil
import statistics
import tempfile
from pathlib import Path

from common import RESULTS, WARMUP, launch, machine, median_spread, step_times

from lightning_pp.layout.schedule import SCHEDULES


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--m", type=int, default=8)
    parser.add_argument("--steps", type=int, default=9)
    parser.add_argument("--rounds", type=int, default=1)
    args = parser.parse_args()
    steps: dict[str, list[float]] = {name: [] for name in SCHEDULES}
    bubbles: dict[str, list[float]] = {name: [] for name in SCHEDULES}
    for _ in range(args.rounds):
        for name in SCHEDULES:
            with tempfile.TemporaryDirectory() as tmp:
                run = launch("run_strategy.py", name, args.m, args.steps, extra=json.dumps({"monitor": tmp}))
                shutil.copy(Path(tmp) / "pipeline_schedule.png", RESULTS / f"schedule_{name}.png")
            steps[name] += step_times(run["ends"])
            bubbles[name] += run["bubbles"][WARMUP:]
            print(name, statistics.median(steps[name]), statistics.median(bubbles[name]), flush=True)
    result = {
        "benchmark": "schedules",
        "machine": machine(),
        "config": {"ranks": 2, "n_microbatches": args.m, "steps": args.steps, "rounds": args.rounds},
        "rows": [
            {"schedule": name, "step_s": median_spread(steps[name]), "bubble": median_spread(bubbles[name])}
            for name in SCHEDULES
        ],
    }
    (RESULTS / "schedules.json").write_text(json.dumps(result, indent=1))


if __name__ == "__main__":
    main()
