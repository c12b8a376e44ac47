"""When one rank fails inside a pipelined step, every rank stops with that rank's message.

A rank blocked in a P2P receive learns of a peer's crash only as "connection closed". The failing
rank therefore writes its error into the process group's store, closes its connections so that
blocked peers wake up, and waits briefly for them to read the message before it re-raises. A step
that timed out names the ranks that stopped (``heartbeat``); a store that no longer answers means
its host, rank 0, stopped or died.
"""

from __future__ import annotations

import contextlib
import threading
import time
import traceback
from collections.abc import Iterator

import torch.distributed as dist
from torch.distributed.distributed_c10d import _get_default_store

from lightning_pp.lifecycle.heartbeat import stopped_ranks

_FAILURE_KEY = "lightning_pp/failure"
_READ_KEY = "lightning_pp/failure_read"
_PEER_GRACE_S = 3.0
_ACK_WAIT_S = 10.0
_STORE_ANSWER_S = 10.0


class PipelinePeerError(RuntimeError):
    """Raised on the ranks that stopped because another rank of the pipeline failed."""


def _read(store: dist.Store, wait_s: float) -> str | None:
    deadline = time.monotonic() + wait_s
    while True:
        if store.check([_FAILURE_KEY]):
            return store.get(_FAILURE_KEY).decode()
        if time.monotonic() >= deadline:
            return None
        time.sleep(0.05)


@contextlib.contextmanager
def failures_shared(rank: int, world_size: int) -> Iterator[None]:
    """Run a step whose communication can strand peers; on failure, tell them why."""
    if not dist.is_initialized() or world_size == 1:
        yield
        return
    store = _get_default_store()
    try:
        yield
    except Exception as error:
        silence = _silence(store)
        if silence is not None:
            raise PipelinePeerError(
                f"Pipeline rank 0 stopped or died: the job's store, which it hosts, {silence}, so rank {rank} stops."
                " Look at rank 0's log; a launcher with restarts (torchrun --max-restarts) starts the job again."
            ) from error
        _share(store, error, rank, world_size)
        raise


def _silence(store: dist.Store) -> str | None:
    """How the store's host fails to answer, or None when it answers. Asked from a thread: a store request to a
    stopped host never returns (the client's timeout bounds only waits for keys)."""
    done, failures = threading.Event(), []

    def ask() -> None:
        try:
            store.add(_READ_KEY, 0)
        except Exception as failure:  # noqa: BLE001  (a host that has exited: the connection is refused or reset)
            failures.append(failure)
        done.set()

    threading.Thread(target=ask, daemon=True).start()
    if not done.wait(_STORE_ANSWER_S):
        return f"has not answered for {_STORE_ANSWER_S:.0f} s"
    return f"is gone ({failures[0]})".splitlines()[0] if failures else None


def _share(store: dist.Store, error: Exception, rank: int, world_size: int) -> None:
    """Raise a peer's message if one failed first; otherwise leave this rank's for the others."""
    first = _read(store, wait_s=0.0)
    if first is None and _is_connection_error(error):
        first = _read(store, wait_s=_PEER_GRACE_S)
    if first is not None and not first.startswith(f"{rank}\n"):
        store.add(_READ_KEY, 1)
        peer, _, message = first.partition("\n")
        raise PipelinePeerError(f"Pipeline rank {peer} failed, so rank {rank} stops too. {message}") from error
    message = "".join(traceback.format_exception_only(type(error), error)).strip()
    stopped = stopped_ranks(world_size) if "timed out" in str(error).lower() else []
    if stopped:
        message = (
            f"Pipeline ranks {stopped} stopped answering (their processes are alive but do not run: SIGSTOP, a"
            f" debugger, a frozen node), so rank {rank} timed out waiting for them. Look at those ranks; a launcher"
            f" with restarts (torchrun --max-restarts) starts the job again. ({message})"
        )
    store.compare_set(_FAILURE_KEY, "", f"{rank}\n{message}")
    if dist.get_backend() == "gloo":
        # closing this rank's sockets wakes peers blocked in a receive from it
        dist.destroy_process_group()
        deadline = time.monotonic() + _ACK_WAIT_S
        while store.add(_READ_KEY, 0) < world_size - 1 - len(stopped) and time.monotonic() < deadline:
            time.sleep(0.05)
    if stopped:
        raise PipelinePeerError(message) from error


def _is_connection_error(error: BaseException) -> bool:
    text = str(error).lower()
    return any(s in text for s in ("connection closed", "connection reset", "broken pipe", "timed out", "peer"))
