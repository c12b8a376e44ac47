"""``compile=True`` against eager: step time and the first step's extra time (compiling), 1F1B on 2 ranks.

    python benchmarks/compiled.py [--m 4] [--steps 10] [--rounds 2] [--ranks 2] [--schedule 1f1b]
                                  [--shapes gpt,encoder]

``--ranks 1 --schedule interleaved_1f1b`` puts both stages on one rank (one GPU holds the pipeline).

Models of ``shapes.py``: the design card's GPT (8 blocks, d=256, AdamW) and 8 ``nn.TransformerEncoderLayer``
(SGD) by default, ``encoder_1024`` (the same layers 1024 wide, the GPU's target) on request, through
``Trainer(strategy=PipelineStrategy(compile=...))`` (inductor, its default mode), one thread per rank as the
allocator sets it on 2 cores. Each round runs every (shape, compile) pair, in another order each round; step times are
medians after the warm-up, the compile time is the first step's time less that median. Writes
benchmarks/results/compiled.json and prints a Markdown table. Targets: on the CPU no slower than eager beyond 3%
(issue 40); on CUDA (``scripts/gpu_check.sh``) >= 1.2x on ``encoder_1024`` (issue 62).
"""

from __future__ import annotations

import argparse
import json
import statistics
from pathlib import Path

from common import RESULTS, launch, machine, median_spread, step_times

HERE = Path(__file__).parent


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--m", type=int, default=4)
    parser.add_argument("--steps", type=int, default=10)
    parser.add_argument("--rounds", type=int, default=2)
    parser.add_argument("--ranks", type=int, default=2)
    parser.add_argument("--schedule", default="1f1b", choices=("gpipe", "1f1b", "interleaved_1f1b"))
    parser.add_argument("--shapes", default="gpt,encoder")
    args = parser.parse_args()
    shapes = args.shapes.split(",")
    runs = [(shape, compiled) for shape in shapes for compiled in (False, True)]
    steps: dict[tuple[str, bool], list[float]] = {run: [] for run in runs}
    first: dict[tuple[str, bool], list[float]] = {run: [] for run in runs}
    for round_ in range(args.rounds):
        for shape, compiled in runs[round_ % len(runs) :] + runs[: round_ % len(runs)]:
            stages = {"stages_per_rank": 2} if args.schedule == "interleaved_1f1b" else {}
            options = json.dumps({"shape": shape, "compile": compiled, **stages})
            result = launch("run_strategy.py", args.schedule, args.m, args.steps, extra=options, ranks=args.ranks)
            steps[shape, compiled] += step_times(result["ends"])
            first[shape, compiled].append(result["ends"][0] - result["start"])
            print(shape, compiled, statistics.median(steps[shape, compiled]), flush=True)
    rows = []
    for shape, compiled in runs:
        step = statistics.median(steps[shape, compiled])
        rows.append({"shape": shape, "compile": compiled, "step_s": median_spread(steps[shape, compiled]),
                     "first_step_extra_s": statistics.median(first[shape, compiled]) - step})  # fmt: skip
    speedup = {s: statistics.median(steps[s, False]) / statistics.median(steps[s, True]) for s in shapes}
    out = {"benchmark": "compiled", "machine": machine(), "rows": rows, "eager_over_compiled": speedup,
           "config": {"schedule": args.schedule, "ranks": args.ranks, "n_microbatches": args.m, "steps": args.steps,
                      "rounds": args.rounds}}  # fmt: skip
    (RESULTS / "compiled.json").write_text(json.dumps(out, indent=1))
    print("| model | compile | step, s (median) | first step's extra, s | eager / compiled |")
    print("| --- | --- | --- | --- | --- |")
    for row in rows:
        ratio = f"{speedup[row['shape']]:.2f}" if row["compile"] else ""
        print(f"| {row['shape']} | {row['compile']} | {row['step_s']['median']:.3f} | {row['first_step_extra_s']:.1f}"
              f" | {ratio} |")  # fmt: skip


if __name__ == "__main__":
    main()
