"""When one rank fails inside a pipelined step, every rank stops with that rank's message.

A rank blocked in a P2P receive learns of a peer's crash only as "connection closed". The failing
rank therefore writes its error into the process group's store, closes its connections so that
blocked peers wake up, and waits briefly for them to read the message before it re-raises.
"""

from __future__ import annotations

import contextlib
import time
import traceback
from collections.abc import Iterator

import torch.distributed as dist
from torch.distributed.distributed_c10d import _get_default_store

_FAILURE_KEY = "lightning_pp/failure"
_READ_KEY = "lightning_pp/failure_read"
_PEER_GRACE_S = 3.0
_ACK_WAIT_S = 10.0


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
        first = _read(store, wait_s=0.0)
        if first is None and _is_connection_error(error):
            first = _read(store, wait_s=_PEER_GRACE_S)
        if first is not None and not first.startswith(f"{rank}\n"):
            store.add(_READ_KEY, 1)
            peer, _, message = first.partition("\n")
            raise PipelinePeerError(f"Pipeline rank {peer} failed, so rank {rank} stops too. {message}") from error
        message = "".join(traceback.format_exception_only(type(error), error)).strip()
        store.compare_set(_FAILURE_KEY, "", f"{rank}\n{message}")
        if dist.get_backend() == "gloo":
            # closing this rank's sockets wakes peers blocked in a receive from it
            dist.destroy_process_group()
            deadline = time.monotonic() + _ACK_WAIT_S
            while store.add(_READ_KEY, 0) < world_size - 1 and time.monotonic() < deadline:
                time.sleep(0.05)
        raise


def _is_connection_error(error: BaseException) -> bool:
    text = str(error).lower()
    return any(s in text for s in ("connection closed", "connection reset", "broken pipe", "timed out", "peer"))
