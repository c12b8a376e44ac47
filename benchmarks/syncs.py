"""Device-to-host synchronisations per steady training step on CUDA, each rank, counted by
``torch.cuda.set_sync_debug_mode("warn")`` from one step's end to the next (Lightning's loop between steps included).

    BENCH_ACCELERATOR=cuda python benchmarks/syncs.py [--ranks 1] [--schedules interleaved_1f1b] [--steps 8]

Through ``Trainer(strategy=PipelineStrategy(...))`` on the design card's GPT (``run_strategy.py`` with ``syncs``),
without a logger or progress bar: the target (issue 62) is none outside logging steps. Each row gives the median
count per step on each rank and the Python lines the synchronisations came from. Writes
benchmarks/results/syncs.json (BENCH_RESULTS) and prints a Markdown table. Needs a CUDA device.
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys

import torch
from common import ACCELERATOR, RESULTS, launch, machine


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--ranks", type=int, default=1)
    parser.add_argument("--schedules", default="interleaved_1f1b")
    parser.add_argument("--m", type=int, default=4)
    parser.add_argument("--steps", type=int, default=8)
    args = parser.parse_args()
    if ACCELERATOR != "cuda" or torch.cuda.device_count() < args.ranks:
        sys.exit(f"syncs.py counts CUDA synchronisations: BENCH_ACCELERATOR=cuda on a machine with {args.ranks} GPU(s)")
    rows = []
    for schedule in args.schedules.split(","):
        per_rank = {"stages_per_rank": 2} if schedule == "interleaved_1f1b" else {}
        options = json.dumps({"shape": "gpt", "syncs": True, **per_rank})
        result = launch("run_strategy.py", schedule, args.m, args.steps, extra=options, ranks=args.ranks)
        rows.append({
            "schedule": schedule, "ranks": args.ranks,
            "per_step": result["syncs"],
            "median_per_step": [statistics.median(counts) if counts else None for counts in result["syncs"]],
            "lines": result["sync_lines"],
        })  # fmt: skip
        print(json.dumps(rows[-1]), flush=True)
    out = {"benchmark": "syncs", "machine": machine(), "config": vars(args), "rows": rows}
    (RESULTS / "syncs.json").write_text(json.dumps(out, indent=1))
    print("| schedule | ranks | syncs per steady step, each rank (median) | where (rank 0) |")
    print("| --- | --- | --- | --- |")
    for row in rows:
        where = ", ".join(f"{line} x{n}" for line, n in row["lines"][0].items())
        print(f"| {row['schedule']} | {row['ranks']} | {row['median_per_step']} | {where} |")


if __name__ == "__main__":
    main()
