"""Resuming reads only this rank's tensors, from either checkpoint format, whatever layout wrote it.

Lightning restores a checkpoint before the strategy's ``setup``, but a stage exists only from the
first batch (placement is learned from it), and a load into meta tensors silently does nothing. So
opening a checkpoint reads no tensor: a full ``.ckpt`` is memory-mapped, a sharded one contributes
its small ``meta.pt`` and meta-device placeholders (names, shapes, dtypes) from its metadata. Once
the rank's stage is materialised, :func:`restore_stage` copies exactly its own weights and optimizer
state: the pages of a mapped file it touches, the byte ranges of a sharded one it asks for.
"""

from __future__ import annotations

import os
from collections.abc import Mapping
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch
from lightning.pytorch.utilities.rank_zero import rank_zero_warn
from torch import nn
from torch.utils._pytree import tree_map_only

from lightning_pp.checkpoints.formats import (
    META_FILE,
    OptimizerLayout,
    is_complete,
    is_sharded,
    one_process_optimizer_state,
)
from lightning_pp.checkpoints.frozen import FROZEN_KEY, check_base
from lightning_pp.checkpoints.integrity import check_checkpoint
from lightning_pp.checkpoints.peer import load_pieces
from lightning_pp.checkpoints.swap import recover
from lightning_pp.checkpoints.trust import SafeReader, load_file, read_dcp
from lightning_pp.errors import PipelineConfigError
from lightning_pp.layout.dtensors import local_tensor, shard_like


@dataclass
class PendingRestore:
    """A checkpoint opened without reading its tensors, and what Lightning asked to restore from it."""

    path: Path
    sharded: bool
    model: Mapping[str, torch.Tensor] | None = None
    strict: bool = True
    optimizers: list[dict[str, Any]] | None = None
    # sharded: each optimizer's parameter names in one-process order (the checkpoint keys its state by name)
    names: list[list[str]] | None = None
    # the frozen base the checkpoint left out (``checkpoints.frozen``): read from init_weights again
    left_out: frozenset[str] = frozenset()
    choice: dict[str, Any] | None = None  # what schedule="auto" chose for the run that saved it
    weights_only: bool | None = None  # as the user passed it: False trusts the checkpoint's objects
    pieces: dict[str, Any] | None = None  # a live replica group's rank's own tensors (``checkpoints.peer``)


def open_checkpoint(
    path: Path, weights_only: bool | None = None, init_weights: str | os.PathLike | None = None
) -> tuple[dict[str, Any], PendingRestore]:
    """The checkpoint dict Lightning restores loops, callbacks and schedulers from; tensors stay on disk.

    A path an interrupted save left empty gives the newest complete checkpoint that save left beside it. A damaged
    checkpoint is refused on every rank, and nothing is read that would run code unless ``weights_only`` is False
    (``checkpoints.integrity``, ``checkpoints.trust``). A checkpoint that left its frozen base out is refused
    unless ``init_weights`` holds that base as it was.
    """
    path, recovered = recover(path, is_complete)
    if recovered:
        rank_zero_warn(recovered)
    check_checkpoint(path, every_rank=True)
    names: list[list[str]] | None = None
    if is_sharded(path):
        checkpoint = load_file(path / META_FILE, weights_only)
        groups = checkpoint.pop("optimizer_param_groups")
        model, optimizers = placeholders(path, trust=weights_only is False)
        checkpoint["state_dict"] = model
        checkpoint["optimizer_states"] = [
            one_process_optimizer_state({"state": optimizers.get(str(i), {}), "param_groups": g})
            for i, g in enumerate(groups)
        ]
        names = [[n for group in g for n in group["params"]] for g in groups]
    else:
        checkpoint = load_file(path, weights_only, mmap=True)
    left_out = check_base(checkpoint.get(FROZEN_KEY), init_weights, path)
    choice = checkpoint.get("pipeline_choice")
    sharded = names is not None
    return checkpoint, PendingRestore(path, sharded, names=names, left_out=left_out, choice=choice,
                                      weights_only=weights_only)  # fmt: skip


def placeholders(
    path: Path, trust: bool = False
) -> tuple[dict[str, torch.Tensor], dict[str, dict[str, dict[str, Any]]]]:
    """Meta tensors in the shape of a sharded checkpoint's weights and optimizer state (read from its metadata)."""
    from torch.distributed.checkpoint.metadata import TensorStorageMetadata

    metadata = SafeReader(path, trust).read_metadata()
    model: dict[str, torch.Tensor] = {}
    optimizers: dict[str, dict[str, dict[str, Any]]] = {}
    for key, entry in metadata.state_dict_metadata.items():
        where = metadata.planner_data[key]
        value: Any = (
            torch.empty(entry.size, dtype=entry.properties.dtype, device="meta")
            if isinstance(entry, TensorStorageMetadata)
            else None  # a non-tensor value (read when asked for)
        )
        if where[0] == "model":
            model[where[1]] = value
        elif where[0] == "optimizers" and where[2] == "state":
            optimizers.setdefault(where[1], {}).setdefault(where[3], {})[where[4]] = value
    return model, optimizers


def check_state_keys(
    expected: Mapping[str, torch.Tensor | None], found: Mapping[str, Any], strict: bool, pending: PendingRestore
) -> None:
    """Names (and shapes, where known here) against the whole module's, so that every rank fails alike
    before any collective. Keys the checkpoint records as left out (its frozen base) are not missing."""
    path = pending.path
    mismatched = [
        f"{k}: checkpoint {tuple(found[k].shape)}, module {tuple(v.shape)}"
        for k, v in expected.items()
        if v is not None and isinstance(found.get(k), torch.Tensor) and tuple(found[k].shape) != tuple(v.shape)
    ]
    missing = [k for k in expected if k not in found and k not in pending.left_out] if strict else []
    unexpected = [k for k in found if k not in expected] if strict else []
    if mismatched or missing or unexpected:
        raise PipelineConfigError(
            f"The checkpoint {path} does not fit the module: missing keys {missing}, unexpected keys {unexpected},"
            f" shape mismatches {mismatched}. Resume with the module that wrote it (same configuration)."
        )


def restore_stage(
    pending: PendingRestore,
    module: nn.Module,
    optimizers: list[torch.optim.Optimizer],
    layouts: list[OptimizerLayout],
) -> int:
    """Load this rank's weights (and optimizer state, if asked) into its materialised stage.

    Returns the bytes of tensors copied out of the checkpoint.
    """
    if pending.pieces is not None:
        return load_pieces(pending.pieces, module, optimizers)
    local = module.state_dict(keep_vars=True)
    wanted_model = [k for k in local if pending.model is not None and k in pending.model]
    wanted_state: list[dict[int, tuple[int, dict[str, Any]]]] = []  # per optimizer: local index -> global, entry
    for o, (states, layout) in enumerate(zip(pending.optimizers or [], layouts)):
        _check_groups(states, layout, pending.path)
        names = [n for group in layout.names for n in group]
        # sharded checkpoints know each entry's parameter name: match by name, not by position
        index = {n: k for k, n in enumerate(pending.names[o])} if pending.names else None
        wanted: dict[int, tuple[int, dict[str, Any]]] = {}
        for j, i in enumerate(i for group in layout.kept for i in group):
            k = i if index is None else index.get(names[i], -1)
            if k in states["state"]:
                wanted[j] = (k, states["state"][k])
        wanted_state.append(wanted)
    if pending.sharded:
        weights, states = _read_sharded(pending, local, wanted_model, wanted_state)
    else:
        assert pending.model is not None or not wanted_model
        weights = {k: pending.model[k] for k in wanted_model}  # type: ignore[index]
        states = [{j: tree_map_only(torch.Tensor, torch.clone, e) for j, (_, e) in w.items()} for w in wanted_state]
    copied = sum(_bytes(t) for t in weights.values())
    if wanted_model and not pending.sharded:  # sharded weights were read in place into the stage's tensors
        module.load_state_dict({k: shard_like(v, local[k]) for k, v in weights.items()}, strict=False)
    for optimizer, layout, state, source in zip(optimizers, layouts, states, pending.optimizers or []):
        params = [p for group in optimizer.param_groups for p in group["params"]]
        state = {j: {k: _like_parameter(v, params[j]) for k, v in e.items()} for j, e in state.items()}
        copied += sum(_bytes(t) for e in state.values() for t in e.values() if torch.is_tensor(t))
        optimizer.load_state_dict({"state": state, "param_groups": _local_groups(source, layout)})
    return copied


def _bytes(t: torch.Tensor) -> int:
    t = local_tensor(t)
    return t.numel() * t.element_size()


def _like_parameter(value: Any, param: torch.Tensor) -> Any:
    """Optimizer state of a sharded or tensor-parallel parameter (momentum, ...) split as the parameter is."""
    if torch.is_tensor(value) and tuple(value.shape) == tuple(param.shape) and value.dim() > 0:
        return shard_like(value, param)
    return value


def _read_sharded(
    pending: PendingRestore,
    local: Mapping[str, torch.Tensor],
    wanted_model: list[str],
    wanted_state: list[dict[int, tuple[int, dict[str, Any]]]],
) -> tuple[dict[str, torch.Tensor], list[dict[int, dict[str, Any]]]]:
    """Ask torch.distributed.checkpoint for this rank's entries only; weights land in the stage's tensors."""
    assert pending.names is not None
    weights = {k: local[k].detach() for k in wanted_model}
    request: dict[str, Any] = {"model": weights, "optimizers": {}}
    for o, wanted in enumerate(wanted_state):
        names = pending.names[o]
        request["optimizers"][str(o)] = {"state": {
            names[i]: {k: torch.empty_like(v, device="cpu") if torch.is_tensor(v) else v for k, v in entry.items()}
            for i, entry in wanted.values()
        }}  # fmt: skip
    with torch.no_grad():
        read_dcp(request, pending.path, pending.weights_only)
    # read back from the request: DCP replaces non-tensor values in its dicts
    states = [
        {j: request["optimizers"][str(o)]["state"][pending.names[o][i]] for j, (i, _) in wanted.items()}
        for o, wanted in enumerate(wanted_state)
    ]
    return weights, states


def _check_groups(states: dict[str, Any], layout: OptimizerLayout, path: Path) -> None:
    found = [len(g["params"]) for g in states["param_groups"]]
    expected = [len(g) for g in layout.groups]
    if found != expected:
        raise PipelineConfigError(
            f"The optimizer state in {path} has parameter groups of sizes {found}, but configure_optimizers built"
            f" {expected}. Resume with the same configure_optimizers as the run that wrote the checkpoint."
        )


def _local_groups(source: dict[str, Any], layout: OptimizerLayout) -> list[dict[str, Any]]:
    """The checkpoint's group settings (lr, betas, ...) over this rank's parameters, numbered locally."""
    groups, start = [], 0
    for group, kept in zip(source["param_groups"], layout.kept):
        groups.append(
            {**{k: v for k, v in group.items() if k != "params"}, "params": list(range(start, start + len(kept)))}
        )
        start += len(kept)
    return groups
