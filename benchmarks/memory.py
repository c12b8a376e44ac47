"""Peak activation memory saved for backward per stage: GPipe against 1F1B (p=2, m=8).

    python benchmarks/memory.py [--m 8] [--steps 3]

Measured through the Trainer and the strategy with saved-tensor hooks (each storage counted once,
parameters excluded). Writes benchmarks/results/memory.json.
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import tempfile
from pathlib import Path

from common import BATCH, MODEL, machine

HERE = Path(__file__).parent


def peaks(schedule: str, m: int, steps: int) -> list[int]:
    with tempfile.TemporaryDirectory() as tmp:
        out = Path(tmp) / "peaks.json"
        env = {**os.environ, "OMP_NUM_THREADS": "1", "PYTHONPATH": str(HERE)}
        subprocess.run(
            [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc_per_node", "2",
             str(HERE / "run_memory.py"), schedule, str(m), str(steps), str(out)],
            check=True, env=env, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL,
        )  # fmt: skip
        return json.loads(out.read_text())["peak_bytes_per_stage"]


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--m", type=int, default=8)
    parser.add_argument("--steps", type=int, default=3)
    args = parser.parse_args()
    gpipe, one_f_one_b = peaks("gpipe", args.m, args.steps), peaks("1f1b", args.m, args.steps)
    result = {
        "benchmark": "memory",
        "machine": machine(),
        "config": {"model": MODEL, "batch": BATCH, "stages": 2, "n_microbatches": args.m, "steps": args.steps},
        "peak_saved_bytes": {"gpipe": gpipe, "1f1b": one_f_one_b},
        "ratio_1f1b_over_gpipe": max(one_f_one_b) / max(gpipe),
        "ratio_per_stage": [b / a for a, b in zip(gpipe, one_f_one_b)],
    }
    path = HERE / "results" / "memory.json"
    path.write_text(json.dumps(result, indent=1))
    print(json.dumps(result, indent=1))


if __name__ == "__main__":
    main()
