"""Step time of ``Trainer(strategy=PipelineStrategy(...))`` against raw ``torch.distributed.pipelining``.

    python benchmarks/overhead.py [--shapes gpt,encoder,...] [--schedules gpipe,1f1b] [--rounds 3] [--steps 10]
                                  [--ranks 2]

Each model of ``shapes.py`` (weights large beside activations and the reverse, plain TransformerEncoderLayers,
the design card's GPT), each schedule, m=8, 2 stages (``--ranks 1 --schedules interleaved_1f1b``: both on one rank,
one GPU holding the pipeline), one thread per rank, both sides launched with torchrun
with no allocator variables set; the strategy's and the raw script's runs alternate, and each run reports
its median step time after the warm-up and its ranks' minor page faults per step. The ratio is the median over
rounds of each round's strategy / raw (the two runs of a round are adjacent in time: this VM's speed drifts by
10-30% between minutes, more than it does within a round); the spread is (max - min) / median of each side's
rounds; each rank's time per step outside torch's ``schedule.step`` (the strategy's own work, or the raw script's
optimizer step: what pairing cannot hide) is reported beside it. A shape may ask for more steps
(``SHAPES[shape]["steps"]``) where its step is short. Writes benchmarks/results/overhead.json and prints a Markdown
table.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics

from common import RESULTS, WARMUP, launch, machine, median_spread, outside_schedule, step_times
from shapes import SHAPES


def timed_run(script: str, shape: str, schedule: str, m: int, steps: int, ranks: int) -> tuple[float, float, list]:
    """Median step time, the ranks' median minor page faults per step, and each rank's median seconds per step
    outside torch's schedule."""
    result = launch(script, schedule, m, steps, extra=json.dumps({"shape": shape}), ranks=ranks)
    faults = [statistics.median(b[0] - a[0] for a, b in zip(f[WARMUP:], f[WARMUP + 1 :])) for f in result["faults"]]
    outside = [outside_schedule(marks) for marks in result["faults"]]
    return statistics.median(step_times(result["ends"])), sum(faults), outside


def spread(values: list[float]) -> float:
    return (max(values) - min(values)) / statistics.median(values)


def main() -> None:
    parser = argparse.ArgumentParser()
    cpu_shapes = [name for name, shape in SHAPES.items() if not shape.get("gpu_only")]
    parser.add_argument("--shapes", default=",".join(cpu_shapes))
    parser.add_argument("--schedules", default="gpipe,1f1b")
    parser.add_argument("--m", type=int, default=8)
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--steps", type=int, default=10)
    parser.add_argument("--ranks", type=int, default=2)
    args = parser.parse_args()
    os.environ.pop("MALLOC_MMAP_THRESHOLD_", None)
    rows = []
    for shape in args.shapes.split(","):
        for schedule in args.schedules.split(","):
            times: dict[str, list[float]] = {"strategy": [], "raw": []}
            faults: dict[str, list[float]] = {"strategy": [], "raw": []}
            outside: dict[str, list[list[float]]] = {"strategy": [], "raw": []}
            for _ in range(args.rounds):  # alternate: the machine is noisy
                for name, script in (("strategy", "run_strategy.py"), ("raw", "run_raw.py")):
                    steps = SHAPES[shape].get("steps", args.steps)
                    step, fault, apart = timed_run(script, shape, schedule, args.m, steps, args.ranks)
                    times[name].append(step)
                    faults[name].append(fault)
                    outside[name].append(apart)
            row = {
                "shape": shape, "about": SHAPES[shape]["about"], "schedule": schedule,
                "step_s": {name: median_spread(values) for name, values in times.items()},
                "faults_per_step": {name: statistics.median(values) for name, values in faults.items()},
                "ratio": statistics.median(s / r for s, r in zip(times["strategy"], times["raw"])),
                "ratio_of_medians": statistics.median(times["strategy"]) / statistics.median(times["raw"]),
                "spread": {name: spread(values) for name, values in times.items()},
                # each rank's seconds per step outside torch's schedule.step, the median over rounds
                "outside_schedule_s": {name: [statistics.median(r[i] for r in per_round) for i in range(args.ranks)]
                                       for name, per_round in outside.items()},
            }  # fmt: skip
            rows.append(row)
            print(json.dumps(row), flush=True)
    result = {
        "benchmark": "overhead",
        "machine": machine(),
        "config": {"n_microbatches": args.m, "stages": 2, "ranks": args.ranks, "threads_per_rank": 1,
                   "rounds": args.rounds,
                   "measured_steps_per_run": {shape: SHAPES[shape].get("steps", args.steps) - WARMUP - 1
                                              for shape in args.shapes.split(",")},
                   "ratio": "median over rounds of strategy / raw within the round"},
        "runs": rows,
    }  # fmt: skip
    (RESULTS / "overhead.json").write_text(json.dumps(result, indent=1))
    print(
        "| model | schedule | strategy step s | raw step s | ratio | spread strategy / raw | faults/step strategy / raw"
        " | ms/step outside the schedule, each rank: strategy / raw |"
    )
    print("| --- | --- | --- | --- | --- | --- | --- | --- |")
    for r in rows:
        s, raw = r["step_s"]["strategy"]["median"], r["step_s"]["raw"]["median"]
        out = {name: ", ".join(f"{1000 * v:.1f}" for v in r["outside_schedule_s"][name])
               for name in ("strategy", "raw")}
        print(f"| {r['shape']} | {r['schedule']} | {s:.3f} | {raw:.3f} | **{r['ratio']:.3f}** | "
              f"{r['spread']['strategy']:.1%} / {r['spread']['raw']:.1%} | "
              f"{r['faults_per_step']['strategy']:.0f} / {r['faults_per_step']['raw']:.0f} | "
              f"{out['strategy']} / {out['raw']} |")  # fmt: skip


if __name__ == "__main__":
    main()
