"""Full checkpoints from pruned stages: one file, in the layout one process would write.

Each rank holds one stage's weights and optimizer state; rank 0 gathers them into the keys and
parameter indices of the whole module, so the file loads with ``Module.load_from_checkpoint`` on
one process and resumes under any stage count (restoring happens before the module is pruned).
"""

from __future__ import annotations

import os
import signal
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist
from torch import nn


@dataclass(frozen=True)
class OptimizerLayout:
    """One-process parameter indices of each param group, and the ones this rank kept."""

    groups: tuple[tuple[int, ...], ...]
    kept: tuple[tuple[int, ...], ...]


def keep_local_parameters(optimizer: torch.optim.Optimizer, local: set[int]) -> OptimizerLayout:
    """Drop parameters (and their state) this rank does not own, keeping the one-process order."""
    start = 0
    groups, kept = [], []
    for group in optimizer.param_groups:
        params = group["params"]
        indices = range(start, start + len(params))
        start += len(params)
        keep = [id(p) in local for p in params]
        for p, k in zip(params, keep):
            if not k:
                optimizer.state.pop(p, None)
        group["params"] = [p for p, k in zip(params, keep) if k]
        groups.append(tuple(indices))
        kept.append(tuple(i for i, k in zip(indices, keep) if k))
    return OptimizerLayout(tuple(groups), tuple(kept))


def _to_cpu(obj: Any) -> Any:
    if isinstance(obj, torch.Tensor):
        return obj.detach().cpu()
    if isinstance(obj, dict):
        return {k: _to_cpu(v) for k, v in obj.items()}
    if isinstance(obj, (list, tuple)):
        return type(obj)(_to_cpu(v) for v in obj)
    return obj


def _gather(obj: Any, group: dist.ProcessGroup | None, dst: int) -> list[Any] | None:
    out: list[Any] | None = [None] * dist.get_world_size(group) if dist.get_rank() == dst else None
    dist.gather_object(_to_cpu(obj), out, dst=dst, group=group)
    return out


def gather_model_state(
    module: nn.Module, key_order: list[str], group: dist.ProcessGroup | None, dst: int = 0
) -> dict[str, Any]:
    """The whole module's state dict on ``dst`` (empty elsewhere), keys in one-process order."""
    parts = _gather(module.state_dict(), group, dst)
    if parts is None:
        return {}
    merged: dict[str, Any] = {}
    for part in parts:
        merged.update(part)
    ordered = {k: merged.pop(k) for k in key_order if k in merged}
    ordered.update(merged)
    return ordered


def gather_optimizer_state(
    optimizer: torch.optim.Optimizer, layout: OptimizerLayout, group: dist.ProcessGroup | None, dst: int = 0
) -> dict[str, Any]:
    """The optimizer state dict one process would save, on ``dst`` (empty elsewhere)."""
    local = optimizer.state_dict()
    to_global = [i for kept in layout.kept for i in kept]
    state = {to_global[i]: v for i, v in local["state"].items()}
    parts = _gather(state, group, dst)
    if parts is None:
        return {}
    merged: dict[int, Any] = {}
    for part in parts:
        merged.update(part)
    param_groups = [{**g, "params": list(layout.groups[i])} for i, g in enumerate(local["param_groups"])]
    return {"state": dict(sorted(merged.items())), "param_groups": param_groups}


# A deterministic fault for tests of torn checkpoints: "<rank>:<n>" kills that rank during its n-th
# save, after its part is written and before the checkpoint is renamed into place.
FAULT_ENV = "LIGHTNING_PP_KILL_DURING_SAVE"
_saves = 0


def fault_point(rank: int) -> None:
    global _saves
    _saves += 1
    if os.environ.get(FAULT_ENV) == f"{rank}:{_saves}":
        os.kill(os.getpid(), signal.SIGKILL)


def partial_path(path: Path) -> Path:
    """Where a checkpoint is written before every rank has confirmed its part."""
    return path.with_name(f".{path.name}.partial")
