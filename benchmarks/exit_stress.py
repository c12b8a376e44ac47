"""Many short pipelined runs across schedules: every one must exit 0 on every rank.

    .venv/bin/python benchmarks/exit_stress.py [RUNS]      (default 100; about 12 s per run on 2 cores)

Each run is ``torchrun --nproc_per_node 2 run_exit.py SCHEDULE`` (4 steps with clipping), so a rank that
aborts at interpreter exit (SIGABRT after training) fails the run as it would fail a CI or SLURM job.
Writes ``results/exit_stress.json``: runs, failures per schedule, and the failing runs' output tails.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
import time
from collections import Counter

from common import HERE, machine

SCHEDULES = ["zbv", "1f1b", "dualpipev", "gpipe", "interleaved_1f1b"]


def main(runs: int) -> None:
    env = {**os.environ, "OMP_NUM_THREADS": "1", "PYTHONPATH": str(HERE)}
    counts, failures, failed = Counter(), Counter(), []
    start = time.monotonic()
    for i in range(runs):
        schedule = SCHEDULES[i % len(SCHEDULES)]
        proc = subprocess.run(
            [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc_per_node", "2",
             str(HERE / "run_exit.py"), schedule],
            env=env, capture_output=True, text=True, timeout=300,
        )  # fmt: skip
        counts[schedule] += 1
        if proc.returncode != 0:
            failures[schedule] += 1
            failed.append({"run": i, "schedule": schedule, "returncode": proc.returncode, "tail": proc.stderr[-2000:]})
        print(f"run {i + 1}/{runs} {schedule}: exit {proc.returncode}", flush=True)
    result = {
        "runs": runs,
        "failed": len(failed),
        "per_schedule": {s: {"runs": counts[s], "failed": failures[s]} for s in SCHEDULES},
        "seconds": time.monotonic() - start,
        "failures": failed,
        "machine": machine(),
    }
    (HERE / "results" / "exit_stress.json").write_text(json.dumps(result, indent=1))
    print(f"{runs - len(failed)} of {runs} runs exited 0 on every rank")


if __name__ == "__main__":
    main(int(sys.argv[1]) if len(sys.argv) > 1 else 100)
