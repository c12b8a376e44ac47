"""FSDP2 over a stage's replicas (``data_parallel="fsdp"``): parameters, gradients and optimizer state split.

Each stage's layers, then its other parts, then the stage module torch's ``PipelineStage`` runs are
``fully_shard``-ed over the replicas of that stage, in that order, so that the stage module is the
FSDP root. torch's schedules then drive FSDP themselves (stage.py: no gradient sync or reshard during
the micro-batches, one reduce-scatter per unit in ``perform_reduce_grad``; UNSHARD/RESHARD actions in
the runtime schedules): ``fsdp_reshard="step"``, a stage unsharded for the whole step, the least
communication. ``"microbatch"`` hides FSDP from the stage, which then reshards after every forward
and backward and reduce-scatters every micro-batch's gradients, as plain FSDP (ZeRO-3) does: a rank
holds little more than one layer unsharded, at the price of ~2m all-gathers and m reduce-scatters
per unit per step.

A stage built on meta is materialised one unit at a time, each whole by the name rule and then
sharded, so it never exists unsharded before the first step. ``fully_shard`` replaces every
Parameter object: the rank's module adopts the new ones by name and the user's optimizers are
re-pointed by name.
"""

from __future__ import annotations

from collections.abc import Callable, Collection, Iterable, Mapping
from typing import Any

import torch
from lightning.pytorch.utilities.rank_zero import rank_zero_warn
from torch import nn

from lightning_pp.errors import PipelineConfigError
from lightning_pp.layout.dtensors import has_dtensors
from lightning_pp.layout.options import InitFn, PipelineOptions, Reshard
from lightning_pp.memory.materialize import materialize
from lightning_pp.split.pruned import StageModules, pruned_stages
from lightning_pp.split.stage import Placement, find_layers, get_path
from lightning_pp.split.tied import place_stand_ins
from lightning_pp.split.traced import Tracer


def check_no_user_sharding(module: nn.Module, tensor_parallel_size: int) -> None:
    """The strategy applies FSDP itself, in the order torch's pipeline stages need; a tensor-parallel size
    without a plan is most likely a forgotten ``configure_model``."""
    from torch.distributed.fsdp import FSDPModule

    if tensor_parallel_size > 1 and not has_dtensors(module):
        rank_zero_warn(
            f"tensor_parallel_size={tensor_parallel_size}, but {type(module).__name__} has no tensor-parallel"
            " parameters: its configure_model applied no plan, so every shard computes the whole layers. Apply one"
            " with parallelize_module(block, self.device_mesh['tensor_parallel'], plan) in configure_model."
        )

    sharded = [name or "<root>" for name, m in module.named_modules() if isinstance(m, FSDPModule)]
    if sharded:
        raise PipelineConfigError(
            f"{type(module).__name__} has modules already sharded with fully_shard: {sharded[:4]}. Under"
            " PipelineStrategy the strategy shards each stage itself (it must be the FSDP root torch's pipeline"
            " stage drives): remove fully_shard from configure_model and pass PipelineStrategy(data_parallel='fsdp')."
            " Tensor parallelism (parallelize_module with self.device_mesh['tensor_parallel']) stays in"
            " configure_model."
        )


def stage_units(view: nn.Module, placement: Placement, stage: int) -> list[tuple[str, nn.Module]]:
    """The stage's FSDP units below its root, by qualified name: its layers, then its other parts."""
    layers = find_layers(view, placement.layers_path)
    units = [(f"{placement.layers_path}.{key}", layers[key]) for key in placement.layers_of(stage)]
    for name, stages in placement.parts.items():
        part = get_path(view, name)
        if stage in stages and isinstance(part, nn.Module) and any(True for _ in part.parameters()):
            units.append((name, part))
    return units


def mixed_precision_policy(precision: str) -> Any:
    """FSDP2's policy for Lightning's precision flag: under ``bf16-mixed`` the sharded fp32 weights are all-gathered
    in bf16 and gradients reduced in fp32 (torchtitan's choice); the compute is bf16 under autocast either way."""
    from torch.distributed.fsdp import MixedPrecisionPolicy

    if precision == "bf16-mixed":
        return MixedPrecisionPolicy(param_dtype=torch.bfloat16, reduce_dtype=torch.float32)
    return MixedPrecisionPolicy()


def shard_stages(
    module: nn.Module,
    views: dict[int, nn.Module],
    placement: Placement,
    mesh: Any,
    options: PipelineOptions,
    device: torch.device,
    mp_policy: Any = None,
    loaded: Collection[str] = frozenset(),
    tracer: Tracer | None = None,
    recompute: Callable[[Mapping[str, nn.Module]], None] | None = None,
) -> tuple[StageModules, dict[int, nn.Module]]:
    """This rank's stage modules, each the FSDP root of its stage over ``mesh`` (the stage's replicas): the
    user's forward on the pruned view, or (``tracer``) the batch's traced piece; ``module`` (the rank's pruned
    module) then holds the sharded Parameters. Also each stage's root (generation unshards them)."""
    place_stand_ins(module, views, placement, list(views))
    if tracer is None:
        modules = pruned_stages(views, placement)(True, None)  # type: ignore[arg-type]
        make: StageModules = lambda train, call: modules  # noqa: E731
    else:
        modules, make = tracer.sharded_stages(views, device, recompute)
    roots = dict(zip(views, modules))
    _shard_stages(views, roots, placement, mesh, options.fsdp_reshard, device, options.init_fn, mp_policy, loaded)
    adopt_parameters(module, views.values())
    return make, roots


def _shard_stages(
    views: dict[int, nn.Module],
    roots: dict[int, nn.Module],
    placement: Placement,
    mesh: Any,
    reshard: Reshard,
    device: torch.device,
    init_fn: InitFn | None,
    mp_policy: Any,
    loaded: Collection[str],
) -> None:
    """Materialise and shard each stage unit by unit; ``roots[s]`` (which runs ``views[s]``) becomes its root."""
    from torch.distributed.fsdp import MixedPrecisionPolicy, fully_shard

    options: dict[str, Any] = dict(
        mesh=mesh, reshard_after_forward=reshard == "microbatch", mp_policy=mp_policy or MixedPrecisionPolicy()
    )
    for stage, view in views.items():
        for name, unit in stage_units(view, placement, stage):
            materialize(unit, device, init_fn=init_fn, prefix=name, loaded=loaded, within=view)
            fully_shard(unit, **options)
        materialize(view, device, init_fn=init_fn, loaded=loaded)  # what is left: loose parameters, buffers
        fully_shard(roots[stage], **options)


def adopt_parameters(module: nn.Module, views: Iterable[nn.Module]) -> None:
    """The rank's module takes the Parameters its stages' views now hold (FSDP replaced those it sharded in
    the views' own copies of the containers on the layers' path)."""
    for view in views:
        for name, param in view.named_parameters(remove_duplicate=False):
            parent, _, attr = name.rpartition(".")
            owner = get_path(module, parent) if parent else module
            if owner is not None and owner._parameters.get(attr) is not param and attr in owner._parameters:
                owner._parameters[attr] = param


def repoint_optimizers(
    optimizers: Iterable[torch.optim.Optimizer], names: dict[int, list[str]], module: nn.Module
) -> None:
    """Each optimizer's parameters replaced by the module's Parameters of the same name (and their state moved).

    ``names`` maps ``id`` of the Parameters the optimizers hold to all their names (a tied Parameter may live
    here under its second name only); the caller keeps those Parameters alive until this returns, so that no
    ``id`` is reused.
    """
    current = dict(module.named_parameters(remove_duplicate=False))

    def now(p: nn.Parameter) -> nn.Parameter:
        return next((current[n] for n in names.get(id(p), []) if n in current), p)

    for optimizer in optimizers:
        for group in optimizer.param_groups:
            fresh = [now(p) for p in group["params"]]
            for old, new in zip(group["params"], fresh):
                if old is not new and old in optimizer.state:
                    optimizer.state[new] = optimizer.state.pop(old)
            group["params"] = fresh
