"""A rank that stops without dying (SIGSTOP, a debugger, a frozen node) is named, not only waited for.

A stopped process closes no connection: the ranks waiting on it learn only that a receive timed out
after the process-group timeout (gloo: "Timed out waiting ...ms for recv operation"), which says
nothing about which rank to look at, and in a pipeline the rank that times out is usually a
neighbour of the stopped one, not the stopped one itself. Every rank therefore counts up its own key
in the job's store from a thread of its own; a stopped process stops counting, a busy or blocked one
does not. When a step times out, the counters that no longer move name the ranks that stopped.

Reading the counters costs one store round trip per rank and happens only after a timeout, so the
store's load does not grow with the square of the job's size.
"""

from __future__ import annotations

import atexit
import threading
import time
from datetime import timedelta

import torch.distributed as dist

_BEATS = "lightning_pp/beat"
_INTERVAL_S = (0.2, 5.0)  # a tenth of the timeout, within these bounds
_STILL_BEATS = 3  # a counter that has not moved over this many intervals has stopped
_STOP_WAIT_S = 5.0  # at exit, for a store call in flight to return


class _Heartbeat:
    def __init__(self, store: dist.Store, rank: int, timeout: timedelta) -> None:
        self.store, self.rank = store, rank
        self.interval = min(max(timeout.total_seconds() / 10, _INTERVAL_S[0]), _INTERVAL_S[1])
        self._stop = threading.Event()
        store.add(f"{_BEATS}/{rank}", 1)
        self._thread = threading.Thread(target=self._beat, name="lightning_pp-heartbeat", daemon=True)
        self._thread.start()
        atexit.register(self.stop)

    def stop(self) -> None:
        """The counter stops, and a store call in flight returns first, before the interpreter shuts down.

        The interpreter ends a daemon thread that takes the GIL back once shutdown has begun, and one coming
        back from a store call (C++ that released the GIL) then aborts the process (``terminate called without
        an active exception``, SIGABRT: exit status 134 instead of the job's own 1 or 0). A store call is
        short, but its host may be slow (a loaded machine) or gone (rank 0 exiting first); one to a stopped
        host never returns, so the wait is bounded: that call stays blocked through the exit.
        """
        self._stop.set()
        self._thread.join(_STOP_WAIT_S)

    def _beat(self) -> None:
        while not self._stop.wait(self.interval):
            try:
                self.store.add(f"{_BEATS}/{self.rank}", 1)
            except Exception:  # noqa: BLE001  (the store's host has gone: the job is ending, and this thread with it)
                return

    def counts(self, world_size: int) -> list[int]:
        return [self.store.add(f"{_BEATS}/{r}", 0) for r in range(world_size)]


_running: _Heartbeat | None = None


def start_heartbeat(store: dist.Store, rank: int, timeout: timedelta) -> None:
    """Start this process's counter in its process group's store; a process that runs several jobs in turn (a
    sweep's rank 0, the planner's runs) moves it to each new job's store, where that job's peers count."""
    global _running
    if _running is not None and _running.store is not store:
        _running.stop()
        _running = None
    if _running is None:
        _running = _Heartbeat(store, rank, timeout)


def stopped_ranks(world_size: int) -> list[int]:
    """The other ranks whose counters do not move (waits a few beat intervals to see)."""
    if _running is None:
        return []
    try:
        before = _running.counts(world_size)
        time.sleep(_STILL_BEATS * _running.interval)
        after = _running.counts(world_size)
    except (dist.DistStoreError, dist.DistNetworkError):  # the store's host is the rank that stopped or died
        return []
    return [r for r in range(world_size) if r != _running.rank and before[r] == after[r]]
