"""One rank of the checksum benchmark: a sharded save of MB megabytes per rank, paired rounds with and without
the records (``checkpoints.integrity``), synchronous and in the background, and the check at a resume against
reading the shards back. Rank 0 writes the seconds of each (the slowest rank's).

    torchrun --nproc_per_node P run_checksums.py MB ROUNDS DIR OUT
"""

from __future__ import annotations

import json
import shutil
import sys
import time
from pathlib import Path

import torch
import torch.distributed as dist
import torch.distributed.checkpoint as dcp

from lightning_pp.checkpoints.formats import save_sharded, split_sharded
from lightning_pp.checkpoints.integrity import check_checkpoint, sharded_writer
from lightning_pp.checkpoints.trust import read_dcp


def slowest(seconds: float) -> float:
    value = torch.tensor([seconds], dtype=torch.float64)
    dist.all_reduce(value, op=dist.ReduceOp.MAX)
    return float(value)


def timed(fn) -> float:
    dist.barrier()
    start = time.perf_counter()
    fn()
    return slowest(time.perf_counter() - start)


def main(mb: int, rounds: int, root: Path, out: Path) -> None:
    dist.init_process_group("gloo")
    rank = dist.get_rank()
    weights = {f"layer{rank}.{i}": torch.randn(1024, 1024) for i in range(mb // 4)}  # 4 MB each

    def checkpoint() -> dict:
        return {"state_dict": dict(weights), "optimizer_states": [], "global_step": 1}

    def fresh(name: str) -> Path:
        path = root / name
        if rank == 0:
            shutil.rmtree(path, ignore_errors=True)
        dist.barrier()
        return path

    def background(path: Path, checksums: bool) -> tuple[float, float]:
        shards, _ = split_sharded(checkpoint())
        start = time.perf_counter()
        future = dcp.async_save(shards, storage_writer=sharded_writer(path, checksums))
        returned = time.perf_counter() - start
        future.result()
        return slowest(returned), slowest(time.perf_counter() - start)

    rows = []
    for r in range(rounds):
        row = {}
        order = ("plain", "recorded") if r % 2 == 0 else ("recorded", "plain")
        for kind in order:
            path = fresh(kind)
            row[f"sync_{kind}_s"] = timed(lambda: save_sharded(checkpoint(), path, rank, None, kind == "recorded"))
        for kind in order:
            path = fresh(f"async_{kind}")
            row[f"async_{kind}_blocking_s"], row[f"async_{kind}_done_s"] = background(path, kind == "recorded")
        path = root / "recorded"
        row["check_s"] = timed(lambda: check_checkpoint(path))
        request = {"model": {k: torch.empty_like(v) for k, v in weights.items()}}
        row["read_s"] = timed(lambda: read_dcp(request, path, None))
        rows.append(row)
    if rank == 0:
        out.write_text(json.dumps({"mb_per_rank": mb, "ranks": dist.get_world_size(), "rounds": rows}))
    dist.destroy_process_group()


if __name__ == "__main__":
    main(int(sys.argv[1]), int(sys.argv[2]), Path(sys.argv[3]), Path(sys.argv[4]))
