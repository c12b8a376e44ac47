"""How fast the planner plans hardware this machine does not have, from entered costs.

    python benchmarks/plan_scale.py [--costs llama3_70b_h100]

Plans the entered configuration (lightning_pp/conf/costs/<name>.yaml: Llama 3 70B on 64 H100s) over every
schedule, pipeline size (2 to 64), micro-batch count, stages per rank, balance, recomputation and replica
sharding, under 80 GiB per device; then times single simulations at pipeline sizes up to 1024. Not validated
on this machine: these are the model's predictions, labelled so. Writes benchmarks/results/plan_scale.json.
"""

from __future__ import annotations

import argparse
import json
import time
from pathlib import Path

from common import machine
from hydra import compose, initialize_config_module

from lightning_pp.choose.planner import configurations, plan
from lightning_pp.choose.simulate import Costs, simulate
from lightning_pp.plan.app import entered_costs

HERE = Path(__file__).parent


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--costs", default="llama3_70b_h100")
    parser.add_argument("--memory-limit-mib", type=float, default=80 * 1024)
    args = parser.parse_args()
    with initialize_config_module("lightning_pp.conf", version_base="1.3"):
        cfg = compose("plan", overrides=[f"costs={args.costs}"]).costs
    costs, hardware = entered_costs(cfg)
    devices, batch = int(cfg.devices), int(cfg.batch_size)
    grid = list(configurations(costs.n_layers, devices, batch))
    start = time.perf_counter()
    rows = plan(costs, hardware, devices, batch)
    seconds = time.perf_counter() - start
    fitting = [p for p in rows if p.peak_mib <= args.memory_limit_mib]
    single = {}
    for schedule, pp in [("1f1b", 64), ("zbv", 64), ("1f1b", 256), ("gpipe", 1024), ("1f1b", 1024)]:
        v = 2 if schedule == "zbv" else 1
        n = pp * v
        uniform = Costs((1.0,) * n, (2.0,) * n, (1.0,) * n, (1.0,) * n, message=0.01)
        t0 = time.perf_counter()
        simulate(schedule, pp, 2 * pp, uniform, v)
        single[f"{schedule} pp={pp} m={2 * pp}"] = time.perf_counter() - t0
    result = {
        "benchmark": "plan_scale",
        "machine": machine(),
        "not_validated": f"entered costs ({cfg.name}); predictions of the model, not measurements",
        "config": {
            "costs": args.costs,
            "devices": devices,
            "batch_size": batch,
            "memory_limit_mib": args.memory_limit_mib,
        },
        "grid_configurations": len(grid),
        "predictions": len(rows),
        "plan_seconds": seconds,
        "within_memory_limit": len(fitting),
        "top": [
            {
                "overrides": p.config.overrides(),
                "predicted_step_s": p.step_s,
                "predicted_samples_per_s": p.samples_per_s,
                "predicted_peak_mib": p.peak_mib,
                "bubble": max(p.bubble),
            }
            for p in fitting[:8]
        ],
        "single_simulation_seconds": single,
    }
    path = HERE / "results" / "plan_scale.json"
    path.write_text(json.dumps(result, indent=1))
    print(json.dumps({k: v for k, v in result.items() if k != "top"}, indent=1))
    for p in fitting[:8]:
        c = p.config
        cells = [c.schedule, c.pipeline_parallel_size, devices // c.pipeline_parallel_size, c.data_parallel,
                 c.stages_per_rank, c.n_microbatches, c.balance_mode, "yes" if c.activation_checkpointing else "no",
                 f"{p.step_s:.2f}", f"{p.samples_per_s:.2f}", f"{p.peak_mib / 1024:.1f}",
                 f"{max(p.bubble):.3f}"]  # fmt: skip
        print("| " + " | ".join(map(str, cells)) + " |")


if __name__ == "__main__":
    main()
