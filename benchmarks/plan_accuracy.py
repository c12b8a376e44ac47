"""How well the planner predicts: its ranking and step times against measured runs, p = 2 ranks.

    python benchmarks/plan_accuracy.py [--configs 8] [--rounds 3] [--steps 30] [--model gpt_small]

Plans ``python -m lightning_pp.plan model=<model>`` once, takes the first configuration and others spread
evenly over the ranking, runs each through ``python -m lightning_pp.train`` with the row's overrides (a short
fit, samples/s after the warm-up), in a different order each round, and compares medians: Spearman rank
correlation of predicted and measured samples/s, how far the planner's first choice is from the best
measured, the median step-time error; and the same for the bubble bound (step = a (1 + (p - 1) / (v m)) + b, 4/3
of it with recomputation), the formula a user would reach for, fitted to every measured run. Writes
benchmarks/results/plan_accuracy.json (``plan_accuracy_<model>.json`` for another model).
"""

from __future__ import annotations

import argparse
import csv
import json
import os
import statistics
import subprocess
import sys
import tempfile
from pathlib import Path

from common import machine

HERE = Path(__file__).parent
SHORT = ["trainer.limit_val_batches=0", "trainer.num_sanity_val_steps=0", "trainer.enable_progress_bar=false",
         "trainer.enable_model_summary=false", "logger=csv"]  # fmt: skip


def app(module: str, args: list[str], out: Path) -> None:
    env = {k: v for k, v in os.environ.items() if k != "OMP_NUM_THREADS"}
    subprocess.run([sys.executable, "-m", module, *args, f"hydra.run.dir={out}"], check=True, env=env,
                   stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)  # fmt: skip


def ranks(values: list[float]) -> list[float]:
    order = sorted(range(len(values)), key=lambda i: values[i])
    out = [0.0] * len(values)
    for position, i in enumerate(order):
        out[i] = float(position)
    return out


def spearman(a: list[float], b: list[float]) -> float:
    ra, rb = ranks(a), ranks(b)
    n = len(a)
    return 1 - 6 * sum((x - y) ** 2 for x, y in zip(ra, rb)) / (n * (n * n - 1))


def scores(predicted_step: list[float], measured_step: list[float]) -> dict[str, float]:
    best = min(measured_step)
    first = min(range(len(predicted_step)), key=lambda i: predicted_step[i])
    return {
        "spearman": spearman([-s for s in predicted_step], [-s for s in measured_step]),
        "first_choice_over_best_measured": measured_step[first] / best,
        "median_step_error": statistics.median(abs(p - m) / m for p, m in zip(predicted_step, measured_step)),
    }


def bubble_bound(rows: list[dict], measured_step: list[float]) -> list[float]:
    """step = a (1 + (p - 1) / (v m)) (4/3 with recomputation: one more forward) + b, least squares through every
    measured run: more generous to the formula than the two runs a user would fit it to."""

    def shape(row: dict) -> float:
        p, v, m = int(row["pipeline_parallel_size"]), int(row["stages_per_rank"]), int(row["n_microbatches"])
        return (1 + (p - 1) / (v * m)) * (4 / 3 if row["activation_checkpointing"] == "True" else 1.0)

    xs = [shape(r) for r in rows]
    mx, my = statistics.mean(xs), statistics.mean(measured_step)
    a = sum((x - mx) * (y - my) for x, y in zip(xs, measured_step)) / sum((x - mx) ** 2 for x in xs)
    return [a * x + my - a * mx for x in xs]


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--configs", type=int, default=8)
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--steps", type=int, default=30)
    parser.add_argument("--model", default="gpt_small")
    args = parser.parse_args()
    with tempfile.TemporaryDirectory() as tmp:
        app("lightning_pp.plan", [f"model={args.model}"], Path(tmp) / "plan")
        with (Path(tmp) / "plan" / "plan.csv").open() as f:
            table = list(csv.DictReader(f))
        machine_costs = json.loads((Path(tmp) / "plan" / "costs.json").read_text())
        n = len(table)
        picked = sorted({round(i * (n - 1) / (args.configs - 1)) for i in range(args.configs)})
        rows = [table[i] for i in picked]
        rates: dict[int, list[float]] = {i: [] for i in range(len(rows))}
        for round_ in range(args.rounds):
            order = list(range(len(rows)))
            order = order[round_ % len(order) :] + order[: round_ % len(order)]
            for i in order if round_ % 2 == 0 else order[::-1]:
                out = Path(tmp) / f"run{round_}_{i}"
                overrides = [f"model={args.model}", f"trainer.max_steps={args.steps}", *SHORT]
                app("lightning_pp.train", overrides + rows[i]["overrides"].split(), out)
                rates[i].append(json.loads((out / "result.json").read_text())["samples_per_s"])
                print(rows[i]["overrides"], rates[i][-1], flush=True)
    batch = machine_costs["batch_size"]
    measured = [statistics.median(rates[i]) for i in range(len(rows))]
    measured_step = [batch / r for r in measured]
    predicted_step = [float(r["predicted_step_s"]) for r in rows]
    bound = bubble_bound(rows, measured_step)
    result = {
        "benchmark": "plan_accuracy",
        "machine": machine(),
        "config": {**vars(args), "planned_configurations": n, "plan_rows_picked": [p + 1 for p in picked]},
        "machine_costs": machine_costs["machine"],
        "runs": [
            {
                "plan_row": picked[i] + 1,
                "overrides": rows[i]["overrides"],
                "predicted_step_s": predicted_step[i],
                "measured_step_s": measured_step[i],
                "measured_samples_per_s": rates[i],
                "bubble_bound_step_s": bound[i],
            }
            for i in range(len(rows))
        ],
        "planner": scores(predicted_step, measured_step),
        "bubble_bound_fitted_to_every_run": scores(bound, measured_step),
    }
    name = "plan_accuracy.json" if args.model == "gpt_small" else f"plan_accuracy_{args.model}.json"
    path = HERE / "results" / name
    path.write_text(json.dumps(result, indent=1))
    print(json.dumps({k: result[k] for k in ("planner", "bubble_bound_fitted_to_every_run")}, indent=1))


if __name__ == "__main__":
    main()
