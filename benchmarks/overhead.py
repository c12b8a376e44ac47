"""Step time of ``Trainer(strategy=PipelineStrategy(...))`` against raw ``torch.distributed.pipelining``.

    python benchmarks/overhead.py [--schedule 1f1b] [--m 8] [--rounds 3] [--steps 15]

Same GPT (design card: 8 layers, d=256, vocab 1000, 64 tokens, batch 32), same schedule and
micro-batches, 2 stages, one thread per rank, both launched with torchrun; runs alternate and
each reports the median step time after warm-up. Writes benchmarks/results/overhead.json.
"""

from __future__ import annotations

import argparse
import json
import statistics

from common import RESULTS, WARMUP, launch, machine, median_spread, step_times


def timed_run(script: str, schedule: str, m: int, steps: int) -> list[float]:
    return step_times(launch(script, schedule, m, steps)["ends"])


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--schedule", default="1f1b")
    parser.add_argument("--m", type=int, default=8)
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--steps", type=int, default=15)
    args = parser.parse_args()
    runs: dict[str, list[float]] = {"strategy": [], "raw": []}
    for _ in range(args.rounds):  # alternate: the machine is noisy
        for name, script in (("strategy", "run_strategy.py"), ("raw", "run_raw.py")):
            runs[name].append(statistics.median(timed_run(script, args.schedule, args.m, args.steps)))
    result = {
        "benchmark": "overhead",
        "machine": machine(),
        "config": {"schedule": args.schedule, "n_microbatches": args.m, "stages": 2, "threads_per_rank": 1,
                   "measured_steps_per_run": args.steps - WARMUP - 1, "rounds": args.rounds},
        "step_s": {name: median_spread(values) for name, values in runs.items()},
        "ratio": statistics.median(runs["strategy"]) / statistics.median(runs["raw"]),
    }  # fmt: skip
    path = RESULTS / "overhead.json"
    path.write_text(json.dumps(result, indent=1))
    print(json.dumps(result, indent=1))


if __name__ == "__main__":
    main()
