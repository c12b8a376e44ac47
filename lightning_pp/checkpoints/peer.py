"""A rank's own tensors as a live peer in the same position hands them over: a healing replica group's state.

Under fault tolerance the ranks holding the same stage (and the same shard of it) in every replica group
hold the same tensors, so a group that restarts takes each rank's pieces from its counterpart in a live
group, as they are, without gathering or re-sharding: the module's state and the optimizer's, DTensors
as their local shards (the receiving rank puts each shard back into its own DTensor).
"""

from __future__ import annotations

from typing import Any

import torch
from torch import nn
from torch.distributed.tensor import DTensor
from torch.utils._pytree import tree_map_only

from lightning_pp.errors import PipelineConfigError
from lightning_pp.layout.dtensors import local_tensor


def rank_pieces(module: nn.Module, optimizers: list[torch.optim.Optimizer]) -> dict[str, Any]:
    """This rank's stage and optimizer state as plain tensors (no copy: the sender is waiting for the quorum)."""
    return {
        "model": {k: local_tensor(v).detach() for k, v in module.state_dict(keep_vars=True).items()},
        "optimizers": [tree_map_only(DTensor, local_tensor, o.state_dict()) for o in optimizers],
    }


def load_pieces(pieces: dict[str, Any], module: nn.Module, optimizers: list[torch.optim.Optimizer]) -> int:
    """Copy a peer's pieces into this rank's materialised stage; returns the bytes copied."""
    local = module.state_dict(keep_vars=True)
    given = pieces["model"]
    if set(given) != set(local) or len(pieces["optimizers"]) != len(optimizers):
        raise PipelineConfigError(
            f"The live replica group's rank holds {sorted(set(given) ^ set(local))[:8]} where this rank does not (or"
            f" {len(pieces['optimizers'])} optimizers to this rank's {len(optimizers)}): every replica group must"
            " run the same module, strategy arguments and number of ranks."
        )
    copied = 0
    with torch.no_grad():
        for name, tensor in local.items():
            mine = local_tensor(tensor)
            if tuple(mine.shape) != tuple(given[name].shape):
                raise PipelineConfigError(
                    f"{name}: the live replica group holds {tuple(given[name].shape)}, this rank"
                    f" {tuple(mine.shape)}. Every replica group must run the same layout (ranks, stages, shards)."
                )
            mine.copy_(given[name])
            copied += mine.numel() * mine.element_size()
    for optimizer, state in zip(optimizers, pieces["optimizers"]):
        params = [p for group in optimizer.param_groups for p in group["params"]]
        state["state"] = {i: {k: _like(v, params[int(i)]) for k, v in s.items()} for i, s in state["state"].items()}
        optimizer.load_state_dict(state)
        copied += sum(v.numel() * v.element_size() for s in state["state"].values() for v in s.values()
                      if torch.is_tensor(v))  # fmt: skip
    return copied


def _like(value: Any, param: torch.Tensor) -> Any:
    """An optimizer state shard back into a DTensor where its parameter is one."""
    if isinstance(param, DTensor) and torch.is_tensor(value) and tuple(value.shape) == tuple(param.to_local().shape):
        local = value.to(param.to_local().device)
        return DTensor.from_local(local, param.device_mesh, param.placements, shape=param.shape, stride=param.stride())
    return value
