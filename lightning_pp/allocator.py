"""A CPU rank's process: one share of the cores, and freed tensors returned to the OS.

glibc serves allocations below its mmap threshold from the heap and, by default, raises that
threshold to the size of any mapped block it frees (up to 32 MiB). The first freed gradient,
checkpoint buffer or ``empty_weights`` stand-in lifts it past a layer's parameters, and from then
on every parameter-sized tensor lives in the heap: freed ones stay resident, and new ones land
on untouched pages beside them. Measured on ``benchmarks/large_model.py`` (4 stages, 577 MB on
meta): 0.72-0.77 x the whole model per rank by default, 0.62 with the threshold fixed at 4 MiB.
A lower threshold returns activations as well, but pays a page fault per activation on every
step (1.5x the step time of ``benchmarks/overhead.py`` at 256 KiB, 1.12x at 512 KiB).
"""

from __future__ import annotations

import ctypes
import os
import platform

import torch
from lightning.fabric.utilities.distributed import _set_num_threads_if_needed
from lightning.pytorch.utilities.rank_zero import rank_zero_info

MMAP_THRESHOLD = 4 * 2**20
_M_MMAP_THRESHOLD = -3  # glibc's malloc.h
_fixed = False


def prepare_process(device: torch.device, num_processes: int) -> None:
    """On CPU: threads per rank (Lightning's launcher sets OMP_NUM_THREADS only after spawning the other ranks)
    and glibc's mmap threshold fixed, unless the user chose one with ``MALLOC_MMAP_THRESHOLD_``."""
    if device.type == "cpu":
        _set_num_threads_if_needed(num_processes)
        return_freed_tensors(device)


def return_freed_tensors(device: torch.device) -> None:
    """On CPU, fix glibc's mmap threshold before the first tensor is freed (a build on meta frees a stand-in
    per parameter); once per process."""
    global _fixed
    if _fixed or device.type != "cpu":
        return
    _fixed = True
    if _fix_mmap_threshold(MMAP_THRESHOLD):
        rank_zero_info(
            f"PipelineStrategy: tensors of {MMAP_THRESHOLD // 2**20} MiB and more go back to the OS when freed"
            " (glibc's mmap threshold fixed; set MALLOC_MMAP_THRESHOLD_ to choose another)."
        )


def _fix_mmap_threshold(threshold: int) -> bool:
    if "MALLOC_MMAP_THRESHOLD_" in os.environ or platform.libc_ver()[0] != "glibc":
        return False
    try:
        libc = ctypes.CDLL("libc.so.6")
    except OSError:
        return False
    return bool(libc.mallopt(_M_MMAP_THRESHOLD, threshold))
