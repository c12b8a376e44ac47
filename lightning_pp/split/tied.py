"""Parameters that more than one stage holds, trained as one process trains the one tensor.

A tied embedding and head (GPT-2, nanoGPT), or a part or loose parameter that forward uses on
several stages, lives on every stage that uses it, as in Megatron-LM's embedding group: every
holder starts from one process's value (broadcast from the stage holding the tensor's first owner,
whose initialiser one process runs last), and after each backward the holders' gradients are summed
over just the ranks that hold it, so every copy takes the step one process takes and stays
bit-identical. Clipping counts the tensor on one holder only.

On a rank holding several of its stages (the V schedules put the first and the last stage on one
rank) each further stage's view gets its own Parameter over the same storage: one Parameter in two
stage modules gets silently wrong gradients from torch's split backward, which finds a stage's
weights through their shared AccumulateGrad node. Sharing the storage keeps the stand-in equal to
the optimizer's Parameter through every step and checkpoint load without copying. Under FSDP each
stage is its own FSDP root, so the stand-in is sharded apart from the tensor: it is copied from it
before every step, and its gradient added to the tensor's after the step's reduce-scatter.

Sharded and tensor-parallel holders hold the same piece of the tensor (holders of one replica and
shard have the same data-parallel rank), so the sums and the broadcast act on local pieces.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.distributed as dist
from torch import nn

from lightning_pp.layout.dtensors import local_tensor
from lightning_pp.layout.mesh import Layout
from lightning_pp.split.stage import Placement, Tie, get_path, replace_in_view


@dataclass(frozen=True)
class _Held:
    param: nn.Parameter  # the rank module's Parameter, which the optimizer steps
    stand_ins: tuple[nn.Parameter, ...]  # its Parameters in this rank's further stages' views
    group: dist.ProcessGroup | None  # the ranks of this replica that hold it, when more than this one
    counted: bool  # whether this rank counts it in the global gradient norm


class SharedParameters:
    """This rank's parameters that other stages hold too."""

    def __init__(self, held: list[_Held]) -> None:
        self._held = held

    @property
    def counted_elsewhere(self) -> frozenset[int]:
        """``id``s of parameters whose gradient another rank counts in the global norm."""
        return frozenset(id(h.param) for h in self._held if not h.counted)

    def refresh(self) -> None:
        """Before a step: stand-ins that do not share the tensor's storage (sharded stages) take its value."""
        with torch.no_grad():
            for held in self._held:
                mine = local_tensor(held.param)
                for stand_in in held.stand_ins:
                    theirs = local_tensor(stand_in)
                    if theirs.data_ptr() != mine.data_ptr():
                        theirs.copy_(mine)

    def sum_gradients(self) -> None:
        """After the schedule's backward: every holder's gradient becomes the sum over all holders.

        Every rank takes part for each parameter it holds, in the same order, even with no gradient.
        """
        for held in self._held:
            if not held.param.requires_grad:
                continue
            if held.param.grad is None:
                held.param.grad = torch.zeros_like(held.param)
            for stand_in in held.stand_ins:
                if stand_in.grad is not None:
                    held.param.grad.add_(stand_in.grad)
                    stand_in.grad = None
            if held.group is not None:
                dist.all_reduce(local_tensor(held.param.grad), group=held.group)


def place_stand_ins(module: nn.Module, views: dict[int, nn.Module], placement: Placement, stages: list[int]) -> None:
    """Each further stage of this rank that holds a tied tensor gets its own Parameter in its view, over the same
    storage. Sharded stages place them before FSDP shards each view (each then holds its own shard, which
    ``SharedParameters.refresh`` keeps equal to the tensor's)."""
    for tie in placement.ties:
        local = [s for s in stages if s in tie.stages]
        param = get_path(module, tie.names_on(local[0])[0]) if local else None
        for stage in local[1:]:
            if get_path(views[stage], tie.names_on(stage)[0]) is not param:
                continue  # placed already
            stand_in = nn.Parameter(param.detach(), requires_grad=param.requires_grad)
            for name in tie.names_on(stage):
                replace_in_view(views[stage], name, stand_in)


def share_parameters(
    module: nn.Module, views: dict[int, nn.Module], placement: Placement, layout: Layout
) -> SharedParameters:
    """Stand-ins in ``views`` (this rank's stages, by index), one process's initial values on every holder.

    A collective over the world: every rank creates every holders' group.
    """
    place_stand_ins(module, views, placement, layout.stages)
    groups = _holder_groups(placement.ties, layout)
    held = []
    for tie, group in zip(placement.ties, groups):
        local = [s for s in layout.stages if s in tie.stages]
        if not local:
            continue
        param = get_path(module, tie.names_on(local[0])[0])
        for name in (n for s in local for n in tie.names_on(s)):  # the rank's module holds the one tensor
            parent, _, attr = name.rpartition(".")
            get_path(module, parent)._parameters[attr] = param
        stand_ins = [get_path(views[s], tie.names_on(s)[0]) for s in local[1:]]
        if group is not None:
            with torch.no_grad():
                dist.broadcast(local_tensor(param), src=layout.stage_rank(tie.source), group=group)
        held.append(_Held(param, tuple(stand_ins), group, counted=tie.source in layout.stages))
    return SharedParameters(held)


def _holder_groups(ties: tuple[Tie, ...], layout: Layout) -> list[dist.ProcessGroup | None]:
    """For each tie, the process group of this replica's ranks that hold it (None when only this rank does,
    or none). torch requires every rank to create every group, in the same order."""
    created: dict[tuple[int, ...], dist.ProcessGroup] = {}
    mine: list[dist.ProcessGroup | None] = []
    for tie in ties:
        for replica in range(layout.dp):
            for shard in range(layout.tp):
                ranks = tuple(sorted({layout.stage_rank(s, replica, shard) for s in tie.stages}))
                if len(ranks) > 1 and ranks not in created:
                    created[ranks] = dist.new_group(list(ranks))
        ranks = tuple(sorted({layout.stage_rank(s) for s in tie.stages}))
        mine.append(created.get(ranks) if layout.rank in ranks else None)
    return mine
