"""Pipeline efficiency against the bubble bound, for the strategy (per balance mode) and raw torch.

    python benchmarks/efficiency.py [--ms 2 4 8 16 32] [--balance uniform profile] [--steps 9]

t1 = one process, one thread, the same m micro-batches one after another (run before and after the
pipelined runs of each m, step times pooled); ideal pipelined step
= t1 x (m + p - 1) / (m x p); efficiency = ideal / measured (p = 2, one thread per rank).
For each m the runs alternate (t1, then per schedule the strategy under each balance mode and raw
torch with the tutorial's uniform split); medians over the measured steps. Writes
benchmarks/results/efficiency.json.
"""

from __future__ import annotations

import argparse
import json
import statistics
from pathlib import Path

from common import launch, machine, step_times

HERE = Path(__file__).parent
P = 2


def single_run(m: int, steps: int) -> list[float]:
    return step_times(launch("run_single.py", m, steps, ranks=None)["ends"])


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--ms", type=int, nargs="+", default=[2, 4, 8, 16, 32])
    parser.add_argument("--balance", nargs="+", default=["uniform", "profile"])
    parser.add_argument("--steps", type=int, default=9)
    args = parser.parse_args()
    rows = []
    for m in args.ms:
        before = single_run(m, args.steps)
        pipelined = {}
        for schedule in ("gpipe", "1f1b"):
            for balance in args.balance:
                run = launch("run_strategy.py", schedule, m, args.steps, extra=json.dumps({"balance": balance}))
                pipelined[schedule, balance] = statistics.median(step_times(run["ends"]))
            run = launch("run_raw.py", schedule, m, args.steps)
            pipelined[schedule, "raw"] = statistics.median(step_times(run["ends"]))
        # t1 before and after the pipelined runs, pooled: the machine drifts
        t1 = statistics.median(before + single_run(m, args.steps))
        ideal = t1 * (m + P - 1) / (m * P)
        for schedule in ("gpipe", "1f1b"):
            raw = pipelined[schedule, "raw"]
            measured = {b: pipelined[schedule, b] for b in args.balance}
            rows.append({
                "schedule": schedule, "m": m, "t1_s": t1, "ideal_s": ideal, "raw_s": raw,
                "efficiency_raw": ideal / raw, "bubble_bound": (P - 1) / (m + P - 1),
                **{f"strategy_{b}_s": s for b, s in measured.items()},
                **{f"efficiency_strategy_{b}": ideal / s for b, s in measured.items()},
            })  # fmt: skip
            print(json.dumps(rows[-1]), flush=True)
    result = {"benchmark": "efficiency", "machine": machine(), "stages": P, "steps": args.steps, "rows": rows}
    (HERE / "results" / "efficiency.json").write_text(json.dumps(result, indent=1))


if __name__ == "__main__":
    main()
