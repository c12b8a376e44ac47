"""What a checkpoint costs training: the step times around a sharded save, written synchronously or in the
background (``async_save=True``), and the time from a killed rank to the first step of the attempt torchrun
starts again.

    python benchmarks/async_save.py

The model: the example GPT with 12 blocks of 1024 (151 M parameters, 604 MB), built on meta, 1F1B, SGD, a
sharded save every 4 steps of 20, on 2 and 4 ranks (run_async_save.py). A step that a save follows is
compared with the median of the steps no save touches; in the background the write goes on during the next
steps, which are reported too. Writes benchmarks/results/async_save.json and prints a Markdown table. Target
(issue 30): the steps during a background save within 1.2x a normal step.
"""

from __future__ import annotations

import json
import statistics
import subprocess
import sys
import tempfile
from pathlib import Path

from common import HERE, launch, machine


def stalls(ends: list[float], every: int) -> dict[str, float]:
    """Step times (the first two left out: shape inference) by where they fall: the step in which a save ran
    (the interval after a step that saved), the one after it, and the rest."""
    times = {i + 1: b - a for i, (a, b) in enumerate(zip(ends, ends[1:]))}  # step i+1's interval (0-based steps)
    saved = {s for s in times if s % every == 0}  # the save after step s-1 runs in step s's interval
    after = {s + 1 for s in saved}
    normal = [t for s, t in times.items() if s > 2 and s not in saved | after]
    base = statistics.median(normal)
    return {
        "normal_s": base,
        "with_save_over_normal": statistics.median(times[s] for s in saved if s in times) / base,
        "next_over_normal": statistics.median(times[s] for s in after if s in times) / base,
    }


def restart_seconds() -> float:
    with tempfile.TemporaryDirectory() as tmp:
        out = Path(tmp) / "restart"
        command = [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc_per_node", "2",
                   "--max-restarts", "1", str(HERE / "run_async_save.py"), "restart", str(Path(tmp) / "ckpts"),
                   str(out)]  # fmt: skip
        env = {**__import__("os").environ, "OMP_NUM_THREADS": "1", "PYTHONPATH": str(HERE)}
        subprocess.run(command, check=True, env=env, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
        return float(Path(f"{out}.first").read_text()) - float(Path(f"{out}.kill").read_text())


def main() -> None:
    runs = []
    for ranks in (2, 4):
        for mode in ("sync", "async"):
            with tempfile.TemporaryDirectory() as tmp:
                result = launch("run_async_save.py", mode, tmp, ranks=ranks)
            runs.append({"ranks": ranks, "mode": mode, **stalls(result["ends"], result["every"])})
    restart = restart_seconds()
    result = {"benchmark": "async_save", "machine": machine(), "runs": runs, "kill_to_first_step_s": restart}
    (HERE / "results" / "async_save.json").write_text(json.dumps(result, indent=1))
    print("| ranks | save | normal step, s | step with the save / normal | next step / normal |")
    print("| --- | --- | --- | --- | --- |")
    for r in runs:
        print(f"| {r['ranks']} | {r['mode']} | {r['normal_s']:.2f} | {r['with_save_over_normal']:.2f} |"
              f" {r['next_over_normal']:.2f} |")  # fmt: skip
    print(f"\nKill to the first step of the restarted attempt (2 ranks): {restart:.1f} s")


if __name__ == "__main__":
    main()
