"""What a failure costs: torchft replica groups (``fault_tolerance``) against today's torchrun restart of every
rank from the last checkpoint.

    python benchmarks/fault_tolerance.py [--steps 600] [--kill-at 30] [--every 20]

Two replicas of a 2-stage GPT (1F1B, 4 CPU processes, gloo, one thread each): two torchft groups of 2 ranks, or
one job of 4 ranks (2 DDP replicas) checkpointing every ``--every`` steps. Each runs ``--steps`` steps without a
failure and again with the last-stage rank of the second replica SIGKILLed as step ``--kill-at`` begins; torchrun
restarts what died (the killed group; the whole job). Lost seconds are the run's wall time over the one without a
failure: for the survivors (the live group: its stall at the failure, and its wall time, which on 2 shared cores
also gains from running alone meanwhile; every replica of the job), and in total, replica-seconds (a group away
from training counts for as long as it is away: from its last step to its first step after healing). Writes
benchmarks/results/fault_tolerance.json and prints a Markdown table.
"""

from __future__ import annotations

import argparse
import json
import os
import socket
import statistics
import subprocess
import sys
import tempfile
from pathlib import Path
from typing import Any

from common import HERE, machine

SHAPE = {"dim": 128, "seq": 64, "batch": 16}


def _port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _torchrun(cfg: dict[str, Any], ranks: int, out: Path) -> subprocess.Popen:
    env = {**os.environ, "OMP_NUM_THREADS": "1"}
    return subprocess.Popen(
        [sys.executable, "-m", "torch.distributed.run", "--nproc_per_node", str(ranks), "--max_restarts", "1",
         "--monitor_interval", "0.1", "--master_addr", "127.0.0.1", "--master_port", str(_port()),
         str(HERE / "run_fault_tolerance.py"), json.dumps(cfg)],
        env=env, stdout=(out / f"{cfg['tag']}.log").open("a"), stderr=subprocess.STDOUT,
    )  # fmt: skip


def _times(out: Path, tag: str, rank: int) -> list[dict[str, Any]]:
    return [json.loads(line) for line in (out / f"times_{tag}_{rank}.jsonl").read_text().splitlines()]


def _wall(rows: list[dict[str, Any]], start: float) -> float:
    return rows[-1]["time"] - start


def run_ft(common: dict[str, Any], out: Path, tag: str, kill: list[int] | None) -> dict[str, float]:
    from torchft._torchft import LighthouseServer

    lighthouse = LighthouseServer(bind="[::]:0", min_replicas=1, join_timeout_ms=1000, heartbeat_timeout_ms=1000)
    address = f"http://127.0.0.1:{lighthouse.address().rsplit(':', 1)[1]}"
    try:
        procs = [_torchrun({**common, "mode": "ft", "group": g, "lighthouse": address, "tag": f"{tag}_g{g}",
                            "kill": kill if g == 1 else None}, 2, out) for g in (0, 1)]  # fmt: skip
        assert [p.wait(timeout=1200) for p in procs] == [0, 0], tag
    finally:
        lighthouse.shutdown()
    survivor, other = _times(out, f"{tag}_g0", 0), _times(out, f"{tag}_g1", 0)
    first = min(survivor[0]["time"], other[0]["time"])
    result = {"survivor_s": _wall(survivor, first), "other_s": _wall(other, first)}
    if kill:
        steps = {row["step"]: row["time"] for row in survivor}
        gaps = [steps[s + 1] - steps[s] for s in range(1, max(steps)) if s + 1 in steps and s in steps]
        result["survivor_stall_s"] = max(gaps) - statistics.median(gaps)
        before = max(row["time"] for row in other if row["attempt"] == 0)
        back = [row for row in other if row["attempt"] == 1]
        result["killed_away_s"] = back[0]["time"] - before
        result["killed_healed_at_step"] = back[0]["step"]  # past the kill: it healed from the survivor
        assert back[0]["step"] > kill[1], "the killed group came back after the survivor ended: run more --steps"
    return result


def run_restart(common: dict[str, Any], out: Path, tag: str, kill: list[int] | None) -> dict[str, float]:
    proc = _torchrun({**common, "mode": "restart", "tag": tag, "kill": kill}, 4, out)
    assert proc.wait(timeout=1200) == 0, tag
    rows = _times(out, tag, 0)
    return {"every_replica_s": _wall(rows, rows[0]["time"]), "steps_run": len(rows)}


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--steps", type=int, default=600)  # long enough for the killed group to come back
    parser.add_argument("--kill-at", type=int, default=30)
    parser.add_argument("--every", type=int, default=20)
    args = parser.parse_args()
    with tempfile.TemporaryDirectory(dir=HERE.parent) as tmp:
        out = Path(tmp)
        common = {**SHAPE, "steps": args.steps, "every": args.every, "devices": 2, "out": str(out)}
        ft_plain = run_ft(common, out, "ft_plain", None)
        ft_kill = run_ft(common, out, "ft_kill", [1, args.kill_at])
        common = {**common, "devices": 4}
        restart_plain = run_restart(common, out, "restart_plain", None)
        restart_kill = run_restart(common, out, "restart_kill", [3, args.kill_at])
    step_s = restart_plain["every_replica_s"] / args.steps
    ft_survivor_lost = ft_kill["survivor_s"] - ft_plain["survivor_s"]
    restart_lost = restart_kill["every_replica_s"] - restart_plain["every_replica_s"]
    result = {
        "benchmark": "fault_tolerance", "machine": machine(), "shape": SHAPE, **vars(args), "step_s": step_s,
        "ft": {"plain": ft_plain, "killed": ft_kill, "survivor_wall_over_plain_s": ft_survivor_lost,
               "total_lost_replica_s": ft_kill["survivor_stall_s"] + ft_kill["killed_away_s"]},
        "restart": {"plain": restart_plain, "killed": restart_kill, "every_replica_lost_s": restart_lost,
                    "total_lost_replica_s": 2 * restart_lost,
                    "steps_redone": restart_kill["steps_run"] - restart_plain["steps_run"]},
    }  # fmt: skip
    (HERE / "results" / "fault_tolerance.json").write_text(json.dumps(result, indent=2))
    print(f"2 replicas x 2 stages, {args.steps} steps of {step_s:.3f} s, one rank killed at step {args.kill_at}")
    print("| | survivors stall (s) | survivors' wall time over no failure (s) | the failed replica is away (s) |"
          " in total (replica-s) | steps redone |")
    print("| --- | --- | --- | --- | --- | --- |")
    print(f"| torchft replica groups | {ft_kill['survivor_stall_s']:.1f} | {ft_survivor_lost:+.1f} |"
          f" {ft_kill['killed_away_s']:.1f} | {result['ft']['total_lost_replica_s']:.1f} | 0 |")
    print(f"| torchrun restart from the last checkpoint (every {args.every}) | {restart_lost:.1f} |"
          f" {restart_lost:+.1f} | {restart_lost:.1f} | {2 * restart_lost:.1f} | {result['restart']['steps_redone']} |")


if __name__ == "__main__":
    main()
