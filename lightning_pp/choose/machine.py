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
from collections.abc import Callable
from dataclasses import asdict, dataclass, replace
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist
from torch import nn

from lightning_pp.runtime.forecast import proc_bytes
from lightning_pp.split.profiling import DeviceSpeed, counted_work

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
    return max(proc_bytes("VmRSS:") - held, 0)


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


def device_speed(device: torch.device, dtype: torch.dtype) -> DeviceSpeed:
    """How fast ``device`` runs what a model built on meta is costed by (its FLOPs and operations counted)."""
    rate = _matmul_rate(device, dtype)
    return DeviceSpeed(rate, _seconds_per_op(device, dtype, rate))


def _matmul_rate(device: torch.device, dtype: torch.dtype) -> float:
    """FLOP/s a square matmul reaches on ``device``."""
    n = 2048 if device.type == "cuda" else 256
    a = torch.ones(n, n, device=device, dtype=dtype)
    return 2 * n**3 / _median_seconds(lambda: a @ a, device)


def _seconds_per_op(device: torch.device, dtype: torch.dtype, rate: float) -> float:
    """What each operation of a small network's forward and backward costs on ``device`` beyond its FLOPs at
    ``rate``: blocks of a Linear, a LayerNorm and a GELU, 16 wide, as a transformer's layers call them (on this
    project's CPU machine 11-14 us alone, against 8-12 us in a 64-wide GPT block or an encoder layer, 6 in a bare
    MLP). Run with gradients whatever the caller's mode (the sanity check's inference mode), leaving the random
    state as it was."""
    cuda = [device] if device.type == "cuda" else []
    with torch.random.fork_rng(devices=cuda), torch.inference_mode(False), torch.enable_grad():
        probe = nn.Sequential(*(nn.Sequential(nn.Linear(16, 16), nn.LayerNorm(16), nn.GELU()) for _ in range(8)))
        probe = probe.to(device, dtype)
        x = torch.randn(2, 16, device=device, dtype=dtype, requires_grad=True)

        def step() -> None:
            probe(x).sum().backward()

        seconds = _median_seconds(step, device, repeats=10, warm_up=3)
        with counted_work() as work:
            step()
    return max(seconds - work.flops.get_total_flops() / rate, 0.0) / work.ops


def _median_seconds(run: Callable[[], Any], device: torch.device, repeats: int = 5, warm_up: int = 1) -> float:
    """Median wall seconds of ``run`` on ``device`` (its queued work done), after ``warm_up`` runs."""
    sync = torch.cuda.synchronize if device.type == "cuda" else (lambda: None)
    times = []
    for _ in range(warm_up + repeats):
        sync()
        start = time.perf_counter()
        run()
        sync()
        times.append(time.perf_counter() - start)
    return statistics.median(times[warm_up:])


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
