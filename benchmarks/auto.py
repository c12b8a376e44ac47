"""``schedule="auto"`` against the default and a brute-force grid, on 2 ranks, three model shapes.

    python benchmarks/auto.py [--steps 8] [--finalists 3] [--pairs 4]

Runs ``run_strategy.py`` (torchrun, one thread per rank) on three shapes of ``shapes.py``: the design card's GPT
(uniform blocks, AdamW), the same GPT with a vocabulary of 16000 (a heavy head, ``balance.py``'s model) and
``uneven`` (8 residual MLP blocks d=256 whose hidden widths are 512 but 4096 for blocks 4 and 5, SGD). Per shape:

* ``auto``: ``PipelineStrategy(schedule="auto")`` with nothing else given: the first batch chooses the schedule,
  micro-batches, stages per rank and balance (recomputation stays off, as given). The run records what it chose
  (``trainer.strategy.options`` on rank 0) and rank 0's log line (predicted step and peak, planning time).
* the default: what ``PipelineStrategy()`` runs, 1F1B with ``default_microbatches`` (8 for a batch of 32 on 2
  stages), uniform balance. It is a cell of the grid, so the grid's run of it is its measurement.
* the grid: gpipe, 1f1b, interleaved_1f1b, zbv x n_microbatches 4, 8 x balance uniform, profile (16 runs).

Before anything, ``measure_machine()`` (the planner's calibration job) writes this machine's fitted runtime costs
into a fresh ``LIGHTNING_PP_CACHE`` folder, so every ``auto`` run plans with measured costs, not the stand-in.

Round 1 runs every configuration of every shape once (``auto`` first, the grid in another order per shape);
round 2 runs ``auto``, the default and the grid's ``--finalists`` best of round 1 again, in reverse order (a
grid's best of 16 single runs is biased low by noise; measuring it again lowers that bias). Round 3 runs what
``auto`` chose (given explicitly) and the grid's best back to back, ``--pairs`` times in alternating order: the
median of the pairs' ratios is the comparison the VM's drift between minutes disturbs least. A run's time is the
median of its step times after the warm-up (``common.WARMUP``); a configuration's, the median over its runs.
4 ranks are not run: 4 processes on this machine's 2 cores would be oversubscribed and time the scheduler.

Writes benchmarks/results/auto.json and prints a Markdown table: auto's step time and its ratio to the grid's
best (target: within 5%), the default's, auto's choice, the planning time against 10% of 1000 of auto's steps,
auto's predicted peak against the measured one, and the error the strategy itself says after the first steps
(``lightning_pp.runtime.forecast``: the highest rank's peak since its pipeline was built, against its prediction).
The measured ``peak_mib`` is each rank's resident-memory
growth during ``fit``; the prediction includes the process's base (torch, Lightning, gloo), so the table compares
it with the absolute high-water mark (``VmHWM`` since ``fit`` began, which starts from the whole model every rank
builds before the strategy prunes it; for ``auto``'s runs since its pipeline was built, where the strategy's own
check restarts the high-water mark).
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import tempfile
import time
from typing import Any

from common import BATCH, MODEL, RESULTS, launch, machine, median_spread, step_times

from lightning_pp.layout.schedule import default_microbatches

SHAPES = {"gpt": {"shape": "gpt"}, "heavy_head": {"shape": "gpt", "vocab": 16000}, "uneven": {"shape": "uneven"}}
SCHEDULES = ("gpipe", "1f1b", "interleaved_1f1b", "zbv")
MICROBATCHES = (4, 8)
BALANCES = ("uniform", "profile")
GRID = [(s, m, b) for s in SCHEDULES for m in MICROBATCHES for b in BALANCES]
DEFAULT = ("1f1b", default_microbatches(BATCH, "1f1b", 2, 2), "uniform")
AUTO = ("auto", "auto", "auto")


def run(shape: str, config: tuple[Any, Any, Any], steps: int, **given: Any) -> dict[str, Any]:
    schedule, m, balance = config
    options = {**SHAPES[shape], **({} if balance == "auto" else {"balance": balance}), **given}
    start = time.perf_counter()
    result = launch("run_strategy.py", schedule, m, steps, extra=json.dumps(options))
    step = statistics.median(step_times(result["ends"]))
    out = {"step_s": step, "first_step_s": result["ends"][0] - result["start"], "wall_s": time.perf_counter() - start,
           "layers_per_stage": result["layers_per_stage"], "peak_mib": result["peak_mib"],
           "hwm_mib": result["hwm_mib"], "rss_before_fit_mib": result["rss_before_fit_mib"]}  # fmt: skip
    if schedule == "auto":
        out.update(chosen=result["options"], plan=result["plan"])
    print(shape, config, f"{step:.3f} s", out.get("chosen", ""), flush=True)
    return out


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--steps", type=int, default=8)
    parser.add_argument("--finalists", type=int, default=3)
    parser.add_argument("--pairs", type=int, default=4)
    args = parser.parse_args()
    began = time.perf_counter()
    cache = tempfile.mkdtemp(prefix="lightning_pp_cache_")
    os.environ["LIGHTNING_PP_CACHE"] = cache  # the runs' children inherit it
    from lightning_pp.plan.calibrate import measure_machine

    calibration_start = time.perf_counter()
    fitted = measure_machine()
    calibration_s = time.perf_counter() - calibration_start
    print("calibrated:", fitted, f"in {calibration_s:.0f} s", flush=True)
    runs: dict[tuple[str, tuple], list[dict[str, Any]]] = {}
    for i, shape in enumerate(SHAPES):  # round 1: everything once
        grid = GRID[i * 5 % len(GRID) :] + GRID[: i * 5 % len(GRID)]
        for config in [AUTO, *grid]:
            runs.setdefault((shape, config), []).append(run(shape, config, args.steps))
    finalists = {}
    for shape in SHAPES:
        ranked = sorted(GRID, key=lambda c: runs[shape, c][0]["step_s"])
        finalists[shape] = ranked[: args.finalists]
    for shape in reversed(SHAPES):  # round 2: auto, the default and the grid's best again
        for config in reversed(list(dict.fromkeys([AUTO, DEFAULT, *finalists[shape]]))):
            runs[shape, config].append(run(shape, config, args.steps))

    def median(shape: str, config: tuple) -> float:
        return statistics.median(r["step_s"] for r in runs[shape, config])

    bests = {shape: min(GRID, key=lambda c, shape=shape: median(shape, c)) for shape in SHAPES}
    paired = {shape: pairs(shape, runs[shape, AUTO][-1]["chosen"], bests[shape], args) for shape in SHAPES}

    rows = []
    for shape in SHAPES:
        grid = {c: median(shape, c) for c in GRID}
        best = bests[shape]
        autos = runs[shape, AUTO]
        auto_s, default_s = median(shape, AUTO), median(shape, DEFAULT)
        plan = autos[-1]["plan"]
        predicted_peak = statistics.median(r["plan"]["predicted_peak_mib"] for r in autos)
        rows.append({
            "shape": shape, "about": SHAPES[shape],
            "auto": {"step_s": median_spread([r["step_s"] for r in autos]),
                     "chosen": [r["chosen"] for r in autos], "layers_per_stage": [r["layers_per_stage"] for r in autos],
                     "predicted_step_s": [r["plan"]["predicted_step_s"] for r in autos],
                     "planning_s": [r["plan"]["planning_s"] for r in autos],
                     "configurations": plan["configurations"], "log": [r["plan"]["line"] for r in autos],
                     "first_step_s": [r["first_step_s"] for r in autos],
                     "predicted_peak_mib": [r["plan"]["predicted_peak_mib"] for r in autos],
                     "measured_hwm_mib": [r["hwm_mib"] for r in autos],
                     "measured_peak_mib": [r["peak_mib"] for r in autos],
                     "rss_before_fit_mib": [r["rss_before_fit_mib"] for r in autos],
                     "checked": [r["plan"].get("checked") for r in autos]},
            "default": {"config": DEFAULT, "step_s": median_spread([r["step_s"] for r in runs[shape, DEFAULT]]),
                        "first_step_s": [r["first_step_s"] for r in runs[shape, DEFAULT]]},
            "grid": [{"schedule": c[0], "n_microbatches": c[1], "balance": c[2], "step_s": grid[c],
                      "runs": [r["step_s"] for r in runs[shape, c]],
                      "layers_per_stage": runs[shape, c][0]["layers_per_stage"],
                      "hwm_mib": runs[shape, c][0]["hwm_mib"]} for c in GRID],
            "grid_best": {"config": best, "step_s": grid[best]},
            "auto_over_grid_best": auto_s / grid[best],
            "paired": paired[shape],
            "auto_over_default": auto_s / default_s,
            "default_is_grid_best": best == DEFAULT,
            "auto_beats_default": auto_s < default_s,
            "planning_s_median": statistics.median(r["plan"]["planning_s"] for r in autos),
            "ten_percent_of_1000_steps_s": 100 * auto_s,
            "predicted_peak_mib_median": predicted_peak,
            "measured_hwm_mib_max_rank_median": statistics.median(max(r["hwm_mib"]) for r in autos),
            "peak_errors": [r["plan"]["checked"]["peak_error"] for r in autos if "checked" in r["plan"]],
        })  # fmt: skip
    machine_file = next(f for f in sorted(os.listdir(cache)) if f.startswith("machine-"))  # beside the costs cached
    saved = json.loads(open(os.path.join(cache, machine_file)).read())
    out = {
        "benchmark": "auto", "machine": machine(), "rows": rows,
        "config": {"ranks": 2, "batch": BATCH, "model": MODEL, "steps": args.steps, "finalists": args.finalists,
                   "grid": {"schedules": SCHEDULES, "n_microbatches": MICROBATCHES, "balance": BALANCES},
                   "pairs": args.pairs, "default": DEFAULT,
                   "four_ranks": "not run: 4 processes on 2 cores would be oversubscribed"},
        "calibration": {"ran": True, "seconds": calibration_s, "cache": saved},
        "wall_s": time.perf_counter() - began,
    }  # fmt: skip
    (RESULTS / "auto.json").write_text(json.dumps(out, indent=1))
    print("| shape | auto, s | grid's best, s | auto / best | default, s | auto / default | auto chose | planning, s |"
          " 10% of 1000 steps, s | predicted peak / measured HWM, MiB | peak error, first steps | auto's choice / best,"
          " paired |")  # fmt: skip
    print("| --- | --- | --- | --- | --- | --- | --- | --- | --- | --- | --- | --- |")
    for row in rows:
        chosen = row["auto"]["chosen"][-1]
        choice = (f"`{chosen['schedule']}` m={chosen['n_microbatches']} v={chosen['stages_per_rank']} "
                  f"{chosen['balance']}")  # fmt: skip
        b = row["grid_best"]["config"]
        print(f"| {row['shape']} | {row['auto']['step_s']['median']:.3f} | {row['grid_best']['step_s']:.3f} "
              f"(`{b[0]}` m={b[1]} {b[2]}) | {row['auto_over_grid_best']:.2f} | "
              f"{row['default']['step_s']['median']:.3f} | {row['auto_over_default']:.2f} | {choice} | "
              f"{row['planning_s_median']:.1f} | "
              f"{row['ten_percent_of_1000_steps_s']:.0f} | {row['predicted_peak_mib_median']:.0f} / "
              f"{row['measured_hwm_mib_max_rank_median']:.0f} | "
              f"{', '.join(f'{e:+.0%}' for e in row['peak_errors'])} | "
              f"{row['paired']['choice_over_best']:.2f} ({len(row['paired']['ratios'])} pairs) |")  # fmt: skip


def pairs(shape: str, chosen: dict[str, Any], best: tuple, args: argparse.Namespace) -> dict[str, Any]:
    """Auto's choice (given explicitly: no planning) and the grid's best, run back to back ``args.pairs`` times in
    alternating order: the median of each pair's ratio, which this VM's drift between minutes moves far less than a
    ratio of medians taken over the whole benchmark."""
    given = (chosen["schedule"], chosen["n_microbatches"], chosen["balance"])
    extra = {name: chosen[name] for name in ("stages_per_rank", "activation_checkpointing")}
    choice_s, best_s = [], []
    for i in range(args.pairs):
        for which in ("choice", "best") if i % 2 == 0 else ("best", "choice"):
            if which == "choice":
                choice_s.append(run(shape, given, args.steps, **extra)["step_s"])
            else:
                best_s.append(run(shape, best, args.steps)["step_s"])
    ratios = [a / b for a, b in zip(choice_s, best_s)]
    return {"choice": chosen, "grid_best": best, "choice_s": choice_s, "best_s": best_s, "ratios": ratios,
            "choice_over_best": statistics.median(ratios)}  # fmt: skip


if __name__ == "__main__":
    main()
