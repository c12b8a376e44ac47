"""What differs between the torch releases lightning-pp supports (2.13 to 2.15), one named shim each.

Everything else the package uses of ``torch.distributed.pipelining``, FSDP2 and DCP reads the same in
all three (their private names included); a difference found goes here with the test that catches it.
"""

from __future__ import annotations

import re
from typing import Any

import torch

OLDEST = (2, 13)


def _refuse_an_older_torch(version: str) -> None:
    """Below 2.13 the pipelining runtime lacks private hooks this package wraps (``PipelineStage``'s
    ``_post_metadata_inference_cleanup``, seen missing in 2.11): refused at import, not deep in the first step."""
    found = tuple(int(n) for n in re.match(r"(\d+)\.(\d+)", version).groups())
    if found < OLDEST:
        raise ImportError(
            f"lightning-pp needs torch >= {OLDEST[0]}.{OLDEST[1]} (it supports 2.13 to 2.15); this environment has"
            f" torch {version}. Install a supported release, e.g. pip install 'torch>=2.13,<2.16' (with the CUDA"
            " build your machine needs)."
        )


_refuse_an_older_torch(torch.__version__)

try:  # torch >= 2.15: the runtime retires each send at an explicit WAIT_SEND_F/WAIT_SEND_B of the order
    from torch.distributed.pipelining.schedules import _add_wait_send
except ImportError:  # torch 2.13, 2.14: the runtime waits for sends by itself
    _add_wait_send = None


def with_send_waits(order_with_comms: dict[int, list[Any]]) -> dict[int, list[Any]]:
    """A lowered order (sends and receives added) as this torch's runtime runs it: torch 2.15 raises "Pipeline
    sends have no matching wait" at the end of a step whose order has no wait for a send."""
    return order_with_comms if _add_wait_send is None else _add_wait_send(order_with_comms)


def buffers_kept_through_metadata_inference(stage: Any) -> Any:
    """``stage`` (a ``PipelineStage``) whose first-step metadata inference leaves the module's buffers as they were.

    The inference runs real forwards; torch 2.14 backs the buffers up and restores them afterwards, torch 2.13 left
    its updates in (BatchNorm's running statistics moved once more for every new batch signature)."""
    if hasattr(stage, "_pre_metadata_inference_backup"):  # torch >= 2.14 does it itself
        return stage
    prepare, cleanup = stage._prepare_forward_infra, stage._post_metadata_inference_cleanup
    saved: list[tuple[Any, Any]] = []

    def prepare_keeping(*args: Any, **kwargs: Any) -> Any:
        saved[:] = [(b, b.detach().clone()) for b in stage.submod.buffers()]
        return prepare(*args, **kwargs)

    def cleanup_restoring() -> None:
        cleanup()
        for buffer, copy in saved:
            buffer.detach().copy_(copy)
        saved.clear()

    stage._prepare_forward_infra, stage._post_metadata_inference_cleanup = prepare_keeping, cleanup_restoring
    return stage
