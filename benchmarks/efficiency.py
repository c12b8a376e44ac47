"""Pipeline efficiency against the bubble bound, for the strategy and raw torch, GPipe and 1F1B.

    python benchmarks/efficiency.py [--ms 2 4 8 16 32] [--steps 10]

t1 = one process, one thread, the same m micro-batches one after another; ideal pipelined step
= t1 x (m + p - 1) / (m x p); efficiency = ideal / measured (p = 2, one thread per rank).
Runs alternate; medians. Writes benchmarks/results/efficiency.json.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import tempfile
from pathlib import Path

from common import machine
from overhead import WARMUP, timed_run

HERE = Path(__file__).parent
P = 2


def single_run(m: int, steps: int) -> float:
    with tempfile.TemporaryDirectory() as tmp:
        out = Path(tmp) / "times.json"
        env = {**os.environ, "OMP_NUM_THREADS": "1", "PYTHONPATH": str(HERE)}
        subprocess.run([sys.executable, str(HERE / "run_single.py"), str(m), str(steps), str(out)], check=True, env=env)
        ends = json.loads(out.read_text())["ends"]
    return statistics.median(b - a for a, b in zip(ends[WARMUP:], ends[WARMUP + 1 :]))


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--ms", type=int, nargs="+", default=[2, 4, 8, 16, 32])
    parser.add_argument("--steps", type=int, default=10)
    args = parser.parse_args()
    rows = []
    for m in args.ms:
        t1 = single_run(m, args.steps)
        ideal = t1 * (m + P - 1) / (m * P)
        for schedule in ("gpipe", "1f1b"):
            strategy = statistics.median(timed_run("run_strategy.py", schedule, m, args.steps))
            raw = statistics.median(timed_run("run_raw.py", schedule, m, args.steps))
            rows.append({
                "schedule": schedule, "m": m, "t1_s": t1, "ideal_s": ideal, "strategy_s": strategy, "raw_s": raw,
                "efficiency_strategy": ideal / strategy, "efficiency_raw": ideal / raw,
                "bubble_bound": (P - 1) / (m + P - 1),
            })  # fmt: skip
            print(json.dumps(rows[-1]))
    result = {"benchmark": "efficiency", "machine": machine(), "stages": P, "balance": "uniform", "rows": rows}
    (HERE / "results" / "efficiency.json").write_text(json.dumps(result, indent=1))


if __name__ == "__main__":
    main()
