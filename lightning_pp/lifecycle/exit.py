"""A clean exit, every time: the process groups end before the interpreter does.

A process group left to the interpreter's own shutdown is destroyed with its C++ threads still
joinable, or while a peer still talks to it, and the process aborts (``terminate called without an
active exception``, SIGABRT) after the job itself succeeded: a failed job for CI and SLURM. At exit
every rank therefore first waits for the others (so that no peer still sends to it), then destroys
its groups (every subgroup with the default one). A process exiting with an uncaught exception does
not wait for peers that may be gone: it only destroys its groups.
"""

from __future__ import annotations

import atexit
import sys
from datetime import timedelta

import torch.distributed as dist

_EXIT_BARRIER_S = 60.0
_registered = False


def close_process_groups_at_exit() -> None:
    """Register (once per process) the shutdown below; called where the strategy creates the process group."""
    global _registered
    if not _registered:
        atexit.register(close_process_groups)
        _registered = True


def close_process_groups() -> None:
    """Every rank waits for the others, then destroys its process groups (a no-op once done)."""
    if not dist.is_initialized():
        return
    try:
        if getattr(sys, "last_value", None) is None:  # set by the interpreter for an uncaught exception
            _all_ranks_here()
    finally:
        dist.destroy_process_group()


def _all_ranks_here() -> None:
    if dist.get_backend() == "gloo":  # bounded: names a rank that never arrives instead of hanging
        dist.monitored_barrier(timeout=timedelta(seconds=_EXIT_BARRIER_S))
    else:
        dist.barrier()
