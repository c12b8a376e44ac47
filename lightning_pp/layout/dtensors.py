"""Plain tensors and DTensors (FSDP shards, tensor-parallel slices) side by side.

A stage's parameters are plain tensors under ``data_parallel="ddp"`` and DTensors once FSDP or a
tensor-parallel plan holds them. Collectives of the pipeline's own (tied gradients, the gradient
norm, checkpoint gathers) act on what the rank holds; values that must equal one process's (initial
weights, checkpoints) go through the whole tensor.
"""

from __future__ import annotations

import contextlib
from collections.abc import Iterator
from typing import Any

import torch
from torch import nn
from torch.distributed.tensor import DTensor, distribute_tensor


def local_tensor(t: torch.Tensor) -> torch.Tensor:
    """What this rank holds of ``t``: its shard of a DTensor, a plain tensor itself."""
    return t.to_local() if isinstance(t, DTensor) else t


def shard_like(full: torch.Tensor, like: torch.Tensor) -> torch.Tensor:
    """``full`` (the whole tensor, the same on every rank) split as ``like`` is split; plain if ``like`` is.

    No communication: each rank cuts its own piece.
    """
    if not isinstance(like, DTensor) or isinstance(full, DTensor):
        return full
    full = full.to(like.device)
    return distribute_tensor(full, like.device_mesh, like.placements, src_data_rank=None)


def full_value(t: Any) -> Any:
    """The whole tensor of a DTensor (a collective over its mesh: every rank holding a piece calls it)."""
    return t.full_tensor() if isinstance(t, DTensor) else t


def has_dtensors(module: nn.Module) -> bool:
    return any(isinstance(p, DTensor) for p in module.parameters())


@contextlib.contextmanager
def whole_parameters(module: nn.Module) -> Iterator[None]:
    """Inside the block, ``module``'s own meta DTensor parameters are plain meta tensors of their global shape;
    after it, each rank keeps its piece of what the block put there.

    Initialisers then draw the whole tensor by the name rule, as one process does; a random op on a sharded
    DTensor would draw the same numbers on every shard on the CPU, and different ones than one process.
    """
    sharded = {name: p for name, p in module.named_parameters(recurse=False) if isinstance(p, DTensor) and p.is_meta}
    for name, p in sharded.items():
        whole = torch.empty(p.shape, dtype=p.dtype, device="meta")
        module._parameters[name] = nn.Parameter(whole, requires_grad=p.requires_grad)
    try:
        yield
    finally:
        for name, p in sharded.items():
            value = module._parameters[name]
            if value is not None and not value.is_meta:
                piece = distribute_tensor(value.detach(), p.device_mesh, p.placements, src_data_rank=None)
                module._parameters[name] = nn.Parameter(piece, requires_grad=p.requires_grad)
            else:
                module._parameters[name] = p
