"""Memory of a model larger than one device: each rank's peak RSS growth (from before the model is built)
against the whole model's bytes and against its own stage's parameters + gradients (SGD), at 2 and 4
stages, built eagerly and on meta, fresh and resumed from a sharded checkpoint.

    python benchmarks/large_model.py [--steps 2]

The model: the example GPT with 12 blocks of 1024 (151 M parameters, 604 MB), 1F1B, 2 steps of 4 x stages
sequences of 8 tokens, no allocator variables set (the strategy manages glibc's allocator itself:
lightning_pp.memory.allocator), torch's kernels paged in before counting (run_large.py). Writes
benchmarks/results/large_model.json (``large_model_<N>_steps.json`` for other step counts: from the fourth step
a rank whose steps page-fault keeps big tensors in its heap) and prints a Markdown table.
"""

from __future__ import annotations

import argparse
import json
import os
import tempfile
from pathlib import Path

from common import LARGE, launch, machine

HERE = Path(__file__).parent


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--steps", type=int, default=LARGE["steps"])
    steps = parser.parse_args().steps
    os.environ.pop("MALLOC_MMAP_THRESHOLD_", None)
    runs = []
    with tempfile.TemporaryDirectory() as tmp:
        ckpt = Path(tmp) / "two_stages.ckpt"  # written by the fresh 2-stage meta run, resumed by every layout
        for stages in (2, 4):
            for build in ("meta", "eager"):
                for resumed in (False, True):
                    save = str(ckpt) if (stages, build, resumed) == (2, "meta", False) else "-"
                    result = launch(
                        "run_large.py", build, str(ckpt) if resumed else "-", save, extra=str(steps), ranks=stages
                    )
                    whole = result["whole_bytes"]
                    rows = result["ranks"]
                    runs.append({
                        "stages": stages, "build": build, "resumed": resumed, "whole_bytes": whole,
                        "peak_growth_over_whole": [r["peak_growth"] / whole for r in rows],
                        "peak_growth_over_stage_params_and_grads": [
                            r["peak_growth"] / (2 * r["stage_param_bytes"]) for r in rows
                        ],
                        "peak_growth_bytes": [r["peak_growth"] for r in rows],
                        "stage_param_bytes": [r["stage_param_bytes"] for r in rows],
                    })  # fmt: skip
    result = {"benchmark": "large_model", "machine": machine(), "config": {**LARGE, "steps": steps}, "runs": runs}
    name = "large_model.json" if steps == LARGE["steps"] else f"large_model_{steps}_steps.json"
    (HERE / "results" / name).write_text(json.dumps(result, indent=1))
    print("| stages | build | start | peak growth / whole model (max over ranks) | / own stage params+grads |")
    print("| --- | --- | --- | --- | --- |")
    for r in runs:
        start = "resumed" if r["resumed"] else "fresh"
        over_whole, over_stage = max(r["peak_growth_over_whole"]), max(r["peak_growth_over_stage_params_and_grads"])
        print(f"| {r['stages']} | {r['build']} | {start} | {over_whole:.2f} | {over_stage:.2f} |")


if __name__ == "__main__":
    main()
