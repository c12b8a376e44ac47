"""What ``schedule="auto"`` predicted, against what the first training steps measured: said once, on rank 0.

A plan is made from one profile of the first batch (every rank's, averaged); a noisy profile, or a cost the planner
does not model, can make it wrong without anything failing. After the first step (which compiles and warms the caches)
every rank times its steps until the fifth begins, and takes its own peak since the pipeline was built (planning's
profile and the build left out): the device's on a GPU (the allocator's peak plus what lives outside it, the CUDA
context), the process's resident high-water mark on a CPU. Rank 0 says both beside the prediction, and warns
where a rank went over ``memory_limit``: the run is not wrong, but the limit was not kept. A run of fewer than
five training steps says nothing.
"""

from __future__ import annotations

import logging
import statistics
import time

import torch
import torch.distributed as dist
from lightning.fabric.utilities.rank_zero import rank_zero_only

from lightning_pp.layout.options import Forecast

log = logging.getLogger("lightning.pytorch.pipeline")
MEASURED = (2, 4)  # the training steps timed (1-based, inclusive); checked as the fifth begins
_MIB = 2**20


class ForecastCheck:
    """Times this rank's training steps and compares them, and its peak, with ``forecast`` once."""

    def __init__(self, forecast: Forecast, pp_rank: int, device: torch.device) -> None:
        self.forecast, self.pp_rank, self.device = forecast, pp_rank, device
        self._starts: list[float] = []
        _reset_peak(device)

    def training_step_begins(self) -> None:
        """Called by every rank at each training step's start: the check is a collective, at the same step on all."""
        if len(self._starts) > MEASURED[1]:
            return
        self._starts.append(time.perf_counter())
        if len(self._starts) == MEASURED[1] + 1:
            first, last = MEASURED
            step_s = statistics.median(b - a for a, b in zip(self._starts[first - 1 : last], self._starts[first:]))
            peaks: list = [None] * dist.get_world_size()
            dist.all_gather_object(peaks, (self.pp_rank, _peak_bytes(self.device) / _MIB))
            if rank_zero_only.rank == 0:
                _say(self.forecast, step_s, peaks)


def _say(forecast: Forecast, step_s: float, peaks: list[tuple[int, float]]) -> None:
    """Rank 0's line: the prediction, the measurement, and the largest peak's error; a warning per rank over the
    limit."""
    first, last = MEASURED
    rank, (pp_rank, peak) = max(enumerate(peaks), key=lambda item: item[1][1])
    predicted = forecast.peak_mib[pp_rank]
    measured = (  # no peak where the OS keeps no high-water mark (not Linux)
        f", and the highest peak was {peak:.0f} MiB on rank {rank} ({peak / predicted - 1:+.0%} of its predicted"
        f" {predicted:.0f} MiB)"
        if peak > 0
        else ""
    )
    log.info(
        f"schedule='auto' predicted {forecast.step_s:.3f} s a step and a peak of {max(forecast.peak_mib):.0f} MiB"
        f" per rank; training steps {first}-{last} took {step_s:.3f} s ({step_s / forecast.step_s - 1:+.0%}){measured}."
    )
    limit = forecast.limit_mib
    for rank, (pp_rank, peak) in enumerate(peaks):
        if limit is not None and peak > limit:
            log.warning(
                f"Rank {rank} peaked at {peak:.0f} MiB, over memory_limit's {limit:.0f} MiB per rank (predicted"
                f" {forecast.peak_mib[pp_rank]:.0f} MiB): lower memory_limit by the difference, or give the schedule"
                " and balance explicitly."
            )


def _reset_peak(device: torch.device) -> None:
    """Start the peak from here."""
    if device.type == "cuda":
        torch.cuda.reset_peak_memory_stats(device)
        return
    try:
        with open("/proc/self/clear_refs", "w") as f:  # resets VmHWM to the resident size now (Linux)
            f.write("5")
    except OSError:
        pass


def _peak_bytes(device: torch.device) -> int:
    """On a GPU the allocator's peak plus what is in use outside it now, read after the steps: the CUDA context
    grows as the first steps load their kernels (by 132 MiB over a 300 M-parameter GPT's first AdamW steps on an
    H100, torch 2.11), so read when the peak was reset it would fall short."""
    if device.type == "cuda":
        free, total = torch.cuda.mem_get_info(device)
        return total - free - torch.cuda.memory_reserved(device) + torch.cuda.max_memory_reserved(device)
    return proc_bytes("VmHWM:")


def proc_bytes(key: str, path: str = "/proc/self/status") -> int:
    """A field in kB of ``/proc/self/status`` (``VmRSS:``, ``VmHWM:``) or ``/proc/meminfo`` (``MemAvailable:``) in
    bytes; 0 where there is none (not Linux)."""
    try:
        with open(path) as fields:
            return int(next(line for line in fields if line.startswith(key)).split()[1]) * 1024
    except (OSError, StopIteration):
        return 0
