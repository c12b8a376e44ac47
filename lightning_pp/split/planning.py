"""The placement of every part, learned at the first batch from one forward on meta tensors.

The user's step runs up to its model call on the first micro-batch; that call then runs on the meta
device (parameters and buffers swapped to meta for the duration), so learning the structure costs
no memory and no compute whether the module was built on meta or eagerly. A meta-built module whose
forward needs data fails here, on every rank, before any collective; an eagerly built one is then
traced for real on the CPU. Under ``split="trace"`` the placement comes from torch's tracer instead
(see ``lightning_pp.split.traced``). The checks at the end run on every rank before any collective.
"""

from __future__ import annotations

import functools
from collections.abc import Callable
from typing import Any

import torch
from lightning.pytorch import LightningModule
from lightning.pytorch.utilities.rank_zero import rank_zero_info
from torch import nn
from torch.utils._pytree import tree_map_only

from lightning_pp.errors import PipelineConfigError
from lightning_pp.layout.mesh import Layout
from lightning_pp.layout.options import Balance, PipelineOptions
from lightning_pp.layout.schedule import check_microbatches
from lightning_pp.memory.materialize import has_meta_tensors, on_meta
from lightning_pp.split.experts import route_experts
from lightning_pp.split.microbatch import ModelCall, batch_size_of, capture_model_call, split_batch
from lightning_pp.split.partition import resolve_balance
from lightning_pp.split.profiling import agree, count_flops, describe_costs, profile_costs
from lightning_pp.split.pruned import DIFFERS, FAILS, unprunable
from lightning_pp.split.stage import (
    Placement,
    find_layers,
    is_compiled,
    model_entries,
    plan_placement,
    resolution_note,
    resolve_layers,
    trace_forward,
)
from lightning_pp.split.traced import Tracer, traced_placement


@torch.compiler.set_stance("force_eager")
def learn_placement(
    module: LightningModule,
    options: PipelineOptions,
    n_stages: int,
    hook: str,
    args: tuple,
    kwargs: dict,
    n_microbatches: int,
    device: torch.device,
) -> tuple[Placement, Tracer | None]:
    """Where each layer and part lives, the same on every rank; logged on rank 0. Under ``split="trace"`` also
    the tracer that makes each batch signature's pieces. The placement holds the layers' qualified path (see
    ``resolve_layers``): every later user of the path reads it there.

    Blocks the user compiled run eagerly here (``force_eager``): the placement's forward watches every argument
    (``trace_forward``), which made dynamo guard on each layer and recompile per layer, spending its recompile
    limit before training (then eager for the rest of the run, one warning)."""
    layers, balance = resolve_layers(module, options.layers), options.balance
    if options.expert_parallel_size > 1:
        route_experts(module, options.expert_parallel_size)
    if layers != options.layers:
        rank_zero_info(resolution_note(module, options.layers, layers))
    first = split_batch(args[0], n_microbatches)[0]
    norms = batch_statistics_note(module, n_microbatches, batch_size_of(first))
    if norms is not None:
        rank_zero_info(norms)
    entries = model_entries(module, layers)
    call = capture_model_call(module, entries, getattr(module, hook), (first, *args[1:]), kwargs, hook)
    tracer = None
    if options.split == "trace":
        placement, tracer = traced_placement(module, layers, n_stages, balance, call, module.training)
    else:
        prune = functools.partial(
            _learn_by_pruning, module, layers, n_stages, balance, entries[call.entry], call, device
        )
        if options.split == "prune" or not options.traceable:
            placement = prune()
            _refuse_other_results(unprunable(module, placement, call), options.traceable)
        else:
            placement, tracer = _pruned_or_traced(module, layers, n_stages, balance, call, prune)
    rank_zero_info(placement.describe(module))
    return placement, tracer


def batch_statistics_note(module: nn.Module, n_microbatches: int, rows: int) -> str | None:
    """What a module whose BatchNorm layers normalise by the samples they see trains as under the pipeline (each
    micro-batch by its own statistics, as one process accumulating them, which DESIGN.md's exactness excludes), to
    be said once: a default count of micro-batches can leave them one sample each."""
    norms = [name for name, m in module.named_modules() if isinstance(m, nn.modules.batchnorm._BatchNorm)]
    if not norms or n_microbatches == 1:
        return None
    return (
        f"{len(norms)} BatchNorm layer(s) ({', '.join(norms[:3])}{', ...' if len(norms) > 3 else ''}) normalise"
        f" each micro-batch by its own statistics (this batch: {n_microbatches} of {rows} sample(s)), as one"
        " process accumulating them would, not as one process on the whole batch; fewer n_microbatches or a larger"
        " batch give them more samples each."
    )


def _pruned_or_traced(
    module: LightningModule,
    layers: str,
    n_stages: int,
    balance: Balance,
    call: ModelCall,
    prune: Callable[[], Placement],
) -> tuple[Placement, Tracer | None]:
    """``split=None``: pruned where the module's stages compose to its forward (``unprunable``), else traced, said
    once. A meta-built module whose forward needs values (Hugging Face's masks) cannot be pruned, whose structure
    is learned on meta, but is traced."""
    try:
        placement = prune()
    except PipelineConfigError as error:
        if not has_meta_tensors(module):
            raise
        why = f"forward cannot run on meta tensors ({error.__cause__})"
        try:
            return _traced(module, layers, n_stages, balance, call, why)
        except PipelineConfigError as also:
            raise PipelineConfigError(f"{error} (split='trace' failed too: {also})") from also
    why = unprunable(module, placement, call)
    if why is None:
        return placement, None
    return _traced(module, layers, n_stages, balance, call, why)


def _refuse_other_results(why: str | None, traceable: bool) -> None:
    """A forward that pruned stages run to another result would train silently otherwise than one process, and one
    that fails on a stage would fail at the first step with the model's own error. The other reasons the check
    finds fail at the first step, naming the part."""
    trace = "pass split='trace' (torch's tracer splits the model as it is), or " if traceable else ""
    if why is not None and why.startswith(DIFFERS):
        raise PipelineConfigError(
            f"{why}. Each pruned stage runs forward over its own layers only, so training would differ from one"
            f" process: {trace}keep per-layer settings on the layers (an attribute of each, not its position)."
        )
    if why is not None and why.startswith(FAILS):
        raise PipelineConfigError(
            f"{why}. Each pruned stage runs forward with the parts other stages hold set to None: {trace}make"
            " forward skip them and return the hidden state where the later parts are None."
        )


def _traced(
    module: LightningModule, layers: str, n_stages: int, balance: Balance, call: ModelCall, why: str
) -> tuple[Placement, Tracer]:
    rank_zero_info(f"{why}: torch's tracer splits the model as it is (split='trace'); pass split= to choose.")
    return traced_placement(module, layers, n_stages, balance, call, module.training)


def _learn_by_pruning(
    module: LightningModule,
    layers: str,
    n_stages: int,
    balance: Balance,
    model: nn.Module,
    call: ModelCall,
    device: torch.device,
) -> Placement:
    forward = functools.partial(type(model).forward, model)

    def on_meta_inputs(run: Any) -> Any:
        with on_meta(module) as to_meta:
            return run(*to_meta((call.args, call.kwargs)))

    try:
        trace = on_meta_inputs(lambda a, kw: trace_forward(module, layers, lambda: forward(*a, **kw)))
    except PipelineConfigError as error:
        if has_meta_tensors(module):
            raise
        # an eagerly built module whose forward needs values (third-party code often checks its inputs) is
        # traced for real, on the CPU where it stays until it is pruned
        rank_zero_info(f"Tracing the forward with real tensors on the CPU instead: {error.__cause__}")
        on_cpu = tree_map_only(torch.Tensor, lambda t: t.cpu(), (call.args, call.kwargs))
        trace = trace_forward(module, layers, lambda: forward(*on_cpu[0], **on_cpu[1]))
    costs, flops = None, False
    if isinstance(balance, str) and balance.lower() == "profile":
        blocks = find_layers(module, layers)
        # time only what may run whole: a real module on the CPU; anything else is costed in FLOPs
        flops = has_meta_tensors(module) or device.type != "cpu"
        if flops:
            costs = on_meta_inputs(lambda a, kw: count_flops(module, blocks, forward, a, kw))
        else:
            costs = agree(profile_costs(module, blocks, forward, call.args, call.kwargs), device)
    placement = plan_placement(module, layers, n_stages, balance, trace, costs)
    if costs is not None:
        rank_zero_info(describe_costs(costs, list(placement.counts), flops=flops))
    return placement


def check_module(module: LightningModule, layers: str | None, balance: Balance, n_stages: int) -> None:
    """What the module's structure allows, checked on every rank before any collective."""
    path = resolve_layers(module, layers)
    whole = [n or "the LightningModule" for n, m in module.named_modules() if is_compiled(m)
             and (not n or path == n or path.startswith(n + "."))]  # fmt: skip
    if whole:
        raise PipelineConfigError(
            f"{whole[0]} was compiled as a whole (`.compile()`), which the pipeline never calls as one: each rank"
            " runs its stages' parts (and that compile would run eagerly, unseen). Remove that call and pass"
            " PipelineStrategy(compile=True), which compiles each layer of each rank's stages in place."
        )
    n_layers = len(find_layers(module, path))
    resolve_balance("uniform" if isinstance(balance, str) else balance, n_layers, n_stages)


def check_training_setup(module: LightningModule, schedule: str, n_microbatches: int | None, layout: Layout) -> None:
    """What the Trainer's setup allows, checked on every rank before any collective."""
    if not module.automatic_optimization:
        raise PipelineConfigError(
            "automatic_optimization=False (manual optimization) is not supported by PipelineStrategy: the strategy"
            " runs forward and backward itself. Use automatic optimization."
        )
    if n_microbatches is not None:
        check_microbatches(schedule, n_microbatches, layout.pp, layout.n_stages)
