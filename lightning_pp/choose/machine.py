"""What the machine adds to a step whatever the model, and where schedule="auto" keeps it (and a model's measured
costs, ``costs``) between runs.

Messages are timed in the job itself (a ping-pong between two pipeline neighbours, a fraction of a second);
the runtime's cost per action and per step needs short fits of a model of free layers, which only the planner's
calibration job runs (``python -m lightning_pp.plan``, ``measure_machine``): it leaves them in the cache, and
until then the costs measured on this project's CPU machine stand in (said when the choice is made).
"""

from __future__ import annotations

import json
import os
import socket
import statistics
import time
from dataclasses import asdict, dataclass, replace
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist

from lightning_pp.runtime.forecast import status_bytes

_SIZES = (1 << 10, 1 << 22)  # bytes of the two ping-pong messages


@dataclass(frozen=True)
class Machine:
    latency_s: float
    bandwidth_bytes_per_s: float
    action_overhead_s: float  # beyond the computation, per forward or backward a stage runs
    step_overhead_s: float  # per training step beyond the schedule: Lightning's loop, the runner's bookkeeping
    base_bytes: int  # a rank's resident memory with torch, Lightning and the process group but no model
    message_overhead_s: float = 0.0  # a rank's own time per send or receive it posts and waits on

    def message_s(self, nbytes: float) -> float:
        return self.latency_s + nbytes / self.bandwidth_bytes_per_s


# the runtime's costs measured by the calibration job on this project's 2-core CPU machine (gloo)
STAND_IN = Machine(3e-4, 1e9, action_overhead_s=5e-4, step_overhead_s=0.05, base_bytes=0)


def base_bytes(device: torch.device, held: int = 0) -> int:
    """What a rank holds without the model (``Machine.base_bytes``), less ``held`` (the model's bytes already
    there): on a GPU the device's memory in use (the CUDA context, torch's cache, other processes), on a CPU this
    process's resident memory (torch, Lightning, the process group)."""
    if device.type == "cuda":
        free, total = torch.cuda.mem_get_info(device)
        return max(total - free - held, 0)
    return max(status_bytes("VmRSS:") - held, 0)


def ping_pong(
    first: int, second: int, device: torch.device, group: dist.ProcessGroup | None = None
) -> tuple[float, float]:
    """Latency and bandwidth of one message between global ranks ``first`` and ``second``: half a round trip at
    two sizes, as a broadcast from each in turn (every rank of ``group`` takes part: gloo's point-to-point pairs may
    not be connected yet); the first two trips warm up."""
    one_way = []
    for size in _SIZES:
        buffer = torch.zeros(size // 4, device=device)
        times = []
        for _ in range(12):
            start = time.perf_counter()
            dist.broadcast(buffer, first, group)
            dist.broadcast(buffer, second, group)
            times.append((time.perf_counter() - start) / 2)
        one_way.append(statistics.median(times[2:]))
    per_byte = max((one_way[1] - one_way[0]) / (_SIZES[1] - _SIZES[0]), 1e-12)
    return max(one_way[0] - per_byte * _SIZES[0], 0.0), 1.0 / per_byte


def matmul_rate(device: torch.device, dtype: torch.dtype) -> float:
    """FLOP/s a square matmul reaches on ``device``: what a model built on meta is costed at (its FLOPs counted)."""
    n = 2048 if device.type == "cuda" else 256
    a = torch.ones(n, n, device=device, dtype=dtype)
    sync = torch.cuda.synchronize if device.type == "cuda" else (lambda: None)
    times = []
    for _ in range(6):
        sync()
        start = time.perf_counter()
        a @ a
        sync()
        times.append(time.perf_counter() - start)
    return 2 * n**3 / statistics.median(times[1:])


def cache_path(kind: str, key: str) -> Path:
    """One file per host and ``kind`` ("machine" per accelerator, "costs" per model signature);
    ``LIGHTNING_PP_CACHE`` moves the folder."""
    folder = Path(os.environ.get("LIGHTNING_PP_CACHE", Path.home() / ".cache" / "lightning_pp"))
    return folder / f"{kind}-{socket.gethostname()}-{key}.json"


def saved_machine(accelerator: str) -> tuple[Machine | None, bool]:
    """The cached machine, and whether its runtime costs were fitted (by the calibration job) or stand in."""
    try:
        saved = json.loads(cache_path("machine", accelerator).read_text())
    except (OSError, ValueError):
        return None, False
    return Machine(**saved["machine"]), bool(saved["fitted"])


def save_machine(machine: Machine, accelerator: str, fitted: bool = True) -> None:
    write_cache(cache_path("machine", accelerator), {"machine": asdict(machine), "fitted": fitted})


def write_cache(path: Path, value: Any) -> None:
    path.parent.mkdir(parents=True, exist_ok=True)
    partial = path.with_suffix(f".{os.getpid()}")
    partial.write_text(json.dumps(value))
    partial.replace(path)  # a concurrent reader sees the old file or the new one


def with_messages(machine: Machine, latency_s: float, bandwidth: float) -> Machine:
    return replace(machine, latency_s=latency_s, bandwidth_bytes_per_s=bandwidth)
