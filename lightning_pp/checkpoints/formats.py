"""Checkpoints from pruned stages, readable by one process and by any other layout.

Full (default): rank 0 gathers every stage's weights and optimizer state into the keys and
parameter indices of the whole module: one ordinary file that loads with
``Module.load_from_checkpoint`` on one process. Sharded: each rank writes its own parameters and
optimizer state with ``torch.distributed.checkpoint``, keyed by parameter names, into a directory.
Either resumes under any stage count: restoring happens before the module is pruned, into the
whole module and an optimizer that still holds every parameter.
"""

from __future__ import annotations

import zipfile
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist
from torch import nn

from lightning_pp.checkpoints.integrity import META_FILE, check_checkpoint, sharded_writer, write_records
from lightning_pp.checkpoints.swap import fault_point
from lightning_pp.checkpoints.trust import load_file, read_dcp
from lightning_pp.layout.dtensors import full_value


@dataclass(frozen=True)
class OptimizerLayout:
    """One-process parameter indices (and names) of each param group, and the indices this rank kept."""

    groups: tuple[tuple[int, ...], ...]
    kept: tuple[tuple[int, ...], ...]
    names: tuple[tuple[str, ...], ...]


def keep_local_parameters(optimizer: torch.optim.Optimizer, local: set[int], names: dict[int, str]) -> OptimizerLayout:
    """Drop parameters (and their state) this rank does not own, keeping the one-process order.

    ``names`` maps ``id(parameter)`` to its name in the whole module.
    """
    start = 0
    groups, kept, group_names = [], [], []
    for group in optimizer.param_groups:
        params = group["params"]
        indices = range(start, start + len(params))
        start += len(params)
        keep = [id(p) in local for p in params]
        for p, k in zip(params, keep):
            if not k:
                optimizer.state.pop(p, None)
        group_names.append(tuple(names[id(p)] for p in params))
        group["params"] = [p for p, k in zip(params, keep) if k]
        groups.append(tuple(indices))
        kept.append(tuple(i for i, k in zip(indices, keep) if k))
    return OptimizerLayout(tuple(groups), tuple(kept), tuple(group_names))


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


def _whole(obj: Any, keep: bool) -> Any:
    """``obj`` with each DTensor replaced by its whole tensor (a collective over its mesh, so every rank holding
    a piece calls it, in the same order); None where ``keep`` is False, which drops each whole tensor at once."""
    if isinstance(obj, torch.Tensor):
        value = full_value(obj)
        return value if keep else None
    if isinstance(obj, dict):
        return {k: _whole(v, keep) for k, v in obj.items()}
    if isinstance(obj, (list, tuple)):
        return type(obj)(_whole(v, keep) for v in obj)
    return obj


def gather_model_state(
    module: nn.Module,
    key_order: list[str],
    group: dist.ProcessGroup | None,
    writer: bool = True,
    dst: int = 0,
    leave_out: frozenset[str] = frozenset(),
) -> dict[str, Any]:
    """The whole module's state dict on ``dst`` of the writers' pipeline ``group`` (empty elsewhere), keys in
    one-process order. Every rank takes part: sharded tensors are made whole by the ranks that hold them.
    ``leave_out``: names neither gathered nor written (a frozen base ``init_weights`` holds)."""
    state = _whole({k: v for k, v in module.state_dict().items() if k not in leave_out}, keep=writer)
    if not writer:
        return {}
    parts = _gather(state, group, dst)
    if parts is None:
        return {}
    merged: dict[str, Any] = {}
    for part in parts:
        merged.update(part)
    ordered = {k: merged.pop(k) for k in key_order if k in merged}
    ordered.update(merged)
    return ordered


def gather_optimizer_state(
    optimizer: torch.optim.Optimizer,
    layout: OptimizerLayout,
    group: dist.ProcessGroup | None,
    writer: bool = True,
    dst: int = 0,
) -> dict[str, Any]:
    """The optimizer state dict one process would save, on ``dst`` of the writers' ``group`` (empty elsewhere)."""
    local = optimizer.state_dict()
    to_global = [i for kept in layout.kept for i in kept]
    state = _whole({to_global[i]: v for i, v in local["state"].items()}, keep=writer)
    if not writer:
        return {}
    parts = _gather(state, group, dst)
    if parts is None:
        return {}
    merged: dict[int, Any] = {}
    for part in parts:
        merged.update(part)
    param_groups = [{**g, "params": list(layout.groups[i])} for i, g in enumerate(local["param_groups"])]
    return {"state": dict(sorted(merged.items())), "param_groups": param_groups}


# ---------------------------------------------------------------------------- sharded checkpoints

def optimizer_state_by_name(optimizer: torch.optim.Optimizer, layout: OptimizerLayout) -> dict[str, Any]:
    """This rank's optimizer state keyed by parameter name, and the one-process groups by name."""
    local = optimizer.state_dict()
    to_name = [layout.names[g][layout.groups[g].index(i)] for g, kept in enumerate(layout.kept) for i in kept]
    groups = [
        {**{k: v for k, v in group.items() if k != "params"}, "params": list(layout.names[g])}
        for g, group in enumerate(local["param_groups"])
    ]
    return {"state": {to_name[i]: v for i, v in local["state"].items()}, "param_groups": groups}


def one_process_optimizer_state(by_name: dict[str, Any]) -> dict[str, Any]:
    """The optimizer state dict one process would hold, from a name-keyed one."""
    index, state, groups = 0, {}, []
    for group in by_name["param_groups"]:
        indices = []
        for name in group["params"]:
            if name in by_name["state"]:
                state[index] = by_name["state"][name]
            indices.append(index)
            index += 1
        groups.append({**group, "params": indices})
    return {"state": state, "param_groups": groups}


def save_sharded(
    checkpoint: dict[str, Any], path: Path, rank: int, group: dist.ProcessGroup | None, checksums: bool = True
) -> None:
    """Every rank of ``group`` (one pipeline replica, or the world when stages are sharded) writes its weights
    and optimizer state into ``path`` (a directory); DTensors are stored as their pieces with global offsets.
    Global rank 0 then writes the rest of the checkpoint and (``checksums``) every file's size and checksums."""
    import torch.distributed.checkpoint as dcp

    shards, rest = split_sharded(checkpoint)
    writer = sharded_writer(path, checksums)
    dcp.save(shards, storage_writer=writer, process_group=group)
    fault_point(rank, "torn")
    if rank == 0:
        torch.save(rest, path / META_FILE)
        write_records(path, writer, path / META_FILE)


def split_sharded(checkpoint: dict[str, Any]) -> tuple[dict[str, Any], dict[str, Any]]:
    """A checkpoint as DCP's shards (weights, optimizer state) and the rest, which ``META_FILE`` holds."""
    shards = {
        "model": checkpoint.pop("state_dict"),
        "optimizers": {str(i): {"state": opt["state"]} for i, opt in enumerate(checkpoint.get("optimizer_states", []))},
    }
    groups = [opt["param_groups"] for opt in checkpoint.pop("optimizer_states", [])]
    return shards, {**checkpoint, "optimizer_param_groups": groups}


def is_sharded(path: Path) -> bool:
    return path.is_dir() and (path / META_FILE).is_file()


def is_complete(path: Path) -> bool:
    """A sharded directory with its ``meta.pt`` (written last), or a whole ``torch.save`` zip file."""
    return is_sharded(path) if path.is_dir() else zipfile.is_zipfile(path)


def load_sharded(path: Path, weights_only: bool | None = None) -> dict[str, Any]:
    """A sharded checkpoint as the dict one process would have saved (read whole, without collectives), checked
    and read without running code it carries (``weights_only``: see ``checkpoints.trust``)."""
    check_checkpoint(path)
    checkpoint = load_file(path / META_FILE, weights_only)
    shards: dict[str, Any] = {}
    read_dcp(shards, path, weights_only, whole=True)
    groups = checkpoint.pop("optimizer_param_groups")
    checkpoint["state_dict"] = shards["model"]
    optimizers = shards.get("optimizers", {})
    checkpoint["optimizer_states"] = [
        one_process_optimizer_state({"state": optimizers.get(str(i), {}).get("state", {}), "param_groups": g})
        for i, g in enumerate(groups)
    ]
    return checkpoint
