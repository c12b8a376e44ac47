"""A CPU rank's process: one share of the cores, and freed tensors returned to the OS.

glibc serves allocations below its mmap threshold from the heap and, by default, raises that
threshold to the size of any mapped block it frees (up to 32 MiB). The first freed gradient,
checkpoint buffer or ``empty_weights`` stand-in lifts it past a layer's parameters, and from then
on every parameter-sized tensor lives in the heap: freed ones stay resident, and new ones land
on untouched pages beside them. Measured on ``benchmarks/large_model.py`` (4 stages, 577 MB on
meta): 0.72-0.77 x the whole model per rank by default, 0.59 with the threshold fixed at 4 MiB.
A lower threshold returns activations as well, but pays a page fault per activation on every
step (1.5x the step time of ``benchmarks/overhead.py`` at 256 KiB, 1.12x at 512 KiB).

Smaller tensors (activations, their gradients) stay in the heap, where the first step's forwards leave
5-10 MiB of free chunks on a rank of that model just when its backward allocates the weight
gradients: returned before each backward where they are few beside the stage's weights (4-stage
peak 0.594 -> 0.584 x the model), kept where activations dominate. Where all that costs a rank more than 3%
of a step, it is given up: see ``training_step_begins``.
"""

from __future__ import annotations

import ctypes
import logging
import mmap
import os
import platform
import resource
import time
from collections.abc import Callable
from typing import Any

import torch
from lightning.fabric.utilities.distributed import _set_num_threads_if_needed
from lightning.fabric.utilities.rank_zero import rank_prefixed_message
from lightning.pytorch.utilities.rank_zero import rank_zero_debug, rank_zero_only

from lightning_pp.layout.dtensors import local_tensor

MMAP_THRESHOLD = 4 * 2**20
STEADY_MMAP_THRESHOLD = 32 * 2**20  # glibc's ceiling for its adaptive threshold (64-bit)
FAULT_SHARE = 0.03  # of a step's wall time in page faults, past which speed goes before the lean heap
_M_TRIM_THRESHOLD, _M_MMAP_THRESHOLD = -1, -3  # glibc's malloc.h
_fixed = False
_steps = 0  # training steps begun in this process
_third_step: tuple[float, int] | None = None  # wall seconds and page faults when the third began
_trim_s = 0.0  # seconds in malloc_trim since the third step began
_trimming = True  # before each backward, where the heap's free pages are few beside the stage's weights
_log = logging.getLogger("lightning.pytorch.pipeline")
_libc: ctypes.CDLL | None = None  # set once the strategy manages glibc's allocator


def prepare_process(device: torch.device, num_processes: int) -> None:
    """On CPU: threads per rank (Lightning's launcher sets OMP_NUM_THREADS only after spawning the other ranks)
    and glibc's mmap threshold fixed, unless the user chose one with ``MALLOC_MMAP_THRESHOLD_``."""
    if device.type == "cpu":
        _set_num_threads_if_needed(num_processes)
        return_freed_tensors(device)


def return_freed_tensors(device: torch.device) -> None:
    """On CPU, fix glibc's mmap threshold before the first tensor is freed (a build on meta frees a stand-in
    per parameter); once per process."""
    global _fixed, _libc
    if _fixed or device.type != "cpu":
        return
    _fixed = True
    _libc = _fix_mmap_threshold(MMAP_THRESHOLD)
    if _libc is not None:  # the default working as meant: nothing for the user to do, so not at info
        rank_zero_debug(
            f"PipelineStrategy: glibc's mmap threshold fixed at {MMAP_THRESHOLD // 2**20} MiB, so that freed"
            " parameter-sized tensors leave the process (set MALLOC_MMAP_THRESHOLD_ to leave glibc's allocator as"
            " it is)."
        )


def trim_before_backward(pipeline_stage: Any) -> None:
    """Where the strategy manages glibc's allocator (and ``training_step_begins`` has not given that up): before
    each backward pass of ``pipeline_stage`` (full, or either half of a split backward), the heap's free pages go
    back to the OS when they are few beside the stage's weights (a model larger than a device, where the
    gradients about to be allocated make the peak). Where activations dominate the heap, returning it would cost
    a page fault per page at the next forward for no lower peak: it stays."""
    libc = _libc
    if libc is None or not hasattr(libc, "mallinfo2"):  # glibc < 2.33
        return
    weights = sum(local_tensor(p).numel() * p.element_size() for p in pipeline_stage.submod.parameters())
    for name in ("backward_one_chunk", "backward_weight_one_chunk"):
        setattr(pipeline_stage, name, _after_trim(libc, weights // 4, getattr(pipeline_stage, name)))


def return_free_memory(device: torch.device) -> None:
    """What a one-off left free goes back now, so that the steps do not carry it (schedule="auto"'s profile of the
    whole model on every rank, the calibration job's fits): on a GPU torch's cache, on a CPU the heap's free pages
    where the strategy manages glibc's allocator."""
    if device.type == "cuda":
        torch.cuda.empty_cache()
    elif _libc is not None:
        _libc.malloc_trim(0)


def training_step_begins(settle: bool = True) -> None:
    """Keep the lean heap while it costs less than ``FAULT_SHARE`` of a step; past that, glibc's own ways, unless
    ``settle`` is False (a ``memory_limit`` to keep: the heap's fragments are what a cap cannot afford).

    The lean heap costs time twice: the trims before a backward (the call walks the heap's free chunks; the
    pages it returns are faulted in again at the next step), and tensors of 4 MiB and more mapped afresh at
    every micro-batch (autograd computes each micro-batch's weight gradient into a new layer-sized tensor
    before adding it into ``.grad``). Both are measured over this rank's third step (its minor faults times
    what one costs here, and the trims' own time); where they took more, from the fourth step on there are no
    trims, tensors below 32 MiB go to the heap and its top is kept up to 64 MiB when freed, as glibc would
    settle by itself, trading some peak memory (the heap's fragments) for that time, and the rank says so.
    Measured: ``benchmarks/overhead.py``'s ``wide_mlp`` (16 MiB weights, 2 samples per micro-batch) took 1.47x
    raw torch's step lean, 0.94-1.06 settled (three runs)."""
    global _steps, _third_step, _trim_s, _trimming
    _steps += 1
    if _libc is None:
        return
    if _steps == 3:
        _third_step, _trim_s = _clock(), 0.0
    elif _steps == 4 and _third_step is not None:
        wall, faults = (now - then for now, then in zip(_clock(), _third_step))
        share = (faults * _fault_s() + _trim_s) / wall
        if share > FAULT_SHARE and not settle:
            _log.info(
                rank_prefixed_message(
                    f"PipelineStrategy: page faults and heap trims took {share:.0%} of this rank's third training"
                    " step; freed tensors still go back to the OS, as memory_limit needs (without a limit they would"
                    " be kept for reuse: faster steps, a higher peak)",
                    rank_zero_only.rank,
                )
            )
        elif share > FAULT_SHARE:
            _trimming = False
            _libc.mallopt(_M_MMAP_THRESHOLD, STEADY_MMAP_THRESHOLD)
            _libc.mallopt(_M_TRIM_THRESHOLD, 2 * STEADY_MMAP_THRESHOLD)
            _log.info(
                rank_prefixed_message(
                    f"PipelineStrategy: page faults and heap trims took {share:.0%} of this rank's third training"
                    " step, so it now keeps freed tensors below"
                    f" {STEADY_MMAP_THRESHOLD // 2**20} MiB for reuse: faster steps, a peak memory that may grow by"
                    " the heap's fragments (set MALLOC_MMAP_THRESHOLD_=4194304 MALLOC_TRIM_THRESHOLD_=131072 to keep"
                    " the lean heap whatever it costs)",
                    rank_zero_only.rank,
                )
            )


def _clock() -> tuple[float, int]:
    return time.perf_counter(), resource.getrusage(resource.RUSAGE_SELF).ru_minflt


def _fault_s() -> float:
    """Seconds a page fault costs here, with the first write to its page: a fresh 4 MiB block written once."""
    block = mmap.mmap(-1, MMAP_THRESHOLD)
    start, before = _clock()
    torch.frombuffer(block, dtype=torch.uint8).fill_(1)
    end, after = _clock()
    block.close()
    return (end - start) / max(after - before, 1)


class _MallInfo2(ctypes.Structure):
    _fields_ = [(name, ctypes.c_size_t) for name in
                "arena ordblks smblks hblks hblkhd usmblks fsmblks uordblks fordblks keepcost".split()]  # fmt: skip


def _after_trim(libc: ctypes.CDLL, most: int, method: Callable[..., Any]) -> Callable[..., Any]:
    def run(*args: Any, **kwargs: Any) -> Any:
        global _trim_s
        if _trimming and 2**20 <= libc.mallinfo2().fordblks <= most:  # free bytes in the main heap (0.1 ms)
            start = time.perf_counter()
            libc.malloc_trim(0)
            _trim_s += time.perf_counter() - start
        return method(*args, **kwargs)

    return run


def _fix_mmap_threshold(threshold: int) -> ctypes.CDLL | None:
    if "MALLOC_MMAP_THRESHOLD_" in os.environ or platform.libc_ver()[0] != "glibc":
        return None
    try:
        libc = ctypes.CDLL("libc.so.6")
    except OSError:
        return None
    if hasattr(libc, "mallinfo2"):
        libc.mallinfo2.restype = _MallInfo2
    return libc if libc.mallopt(_M_MMAP_THRESHOLD, threshold) else None
