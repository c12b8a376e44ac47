"""``schedule="auto"`` (and ``n_microbatches``, ``balance``, ``stages_per_rank``, ``activation_checkpointing``):
the first batch chooses them for the replicas and pipeline ranks the user gave.

Every rank measures the model on the real batch at once (``costs``: each layer at three micro-batch sizes, through
the user's own step; at once so that each shares the machine as training will), rank 0 times a message to its
pipeline neighbour, simulates every configuration torch accepts for these ranks from the ranks' mean costs
(``planner``) and sends its choice to every rank in one broadcast, so that all run the same; an error (a memory
limit nothing fits under, a rank that could not measure) travels the same way and is raised everywhere. What it
measures leaves the module, its gradients, buffers and the random state as they were: the run trains as one with
the chosen arguments given. The choice is written into each checkpoint; a resumed fit takes it from there without
measuring again.
"""

from __future__ import annotations

import contextlib
import logging
import os
import time
from collections.abc import Mapping
from dataclasses import replace
from typing import Any

import torch
import torch.distributed as dist
from lightning.pytorch.utilities.rank_zero import rank_zero_info
from torch import nn
from torch.utils._pytree import tree_flatten, tree_map

from lightning_pp.checkpoints.restore import PendingRestore
from lightning_pp.choose.costs import (
    counted_costs,
    mean_costs,
    profile_module,
    profiled_sizes,
    save_costs,
    saved_costs,
)
from lightning_pp.choose.machine import (
    STAND_IN,
    Machine,
    base_bytes,
    device_speed,
    ping_pong,
    save_machine,
    saved_machine,
    with_messages,
)
from lightning_pp.choose.planner import Config, ModelCosts, Prediction, plan
from lightning_pp.errors import PipelineConfigError
from lightning_pp.layout.mesh import Layout
from lightning_pp.layout.options import Forecast, InitFn, PipelineOptions, memory_limit_bytes
from lightning_pp.layout.schedule import ASYNC, SCHEDULES, default_microbatches
from lightning_pp.memory.allocator import return_free_memory
from lightning_pp.memory.materialize import materialized
from lightning_pp.runtime.forecast import proc_bytes
from lightning_pp.split.microbatch import batch_size_of

log = logging.getLogger("lightning.pytorch.pipeline")
CHOSEN = ("schedule", "n_microbatches", "stages_per_rank", "balance", "activation_checkpointing")


def chosen_options(
    module: nn.Module,
    batch: Any,
    options: PipelineOptions,
    layout: Layout,
    group: dist.ProcessGroup | None,
    pending: PendingRestore | None,
) -> PipelineOptions:
    """The options with what was "auto" chosen, the same on every rank: the choice of the checkpoint being resumed
    (``pending``) or rank 0's plan, its message to the next stage timed over the pipeline's ``group``."""
    resumed = _resumed(pending.choice if pending else None, options, layout)
    if resumed is not None:
        rank_zero_info(f"The resumed checkpoint's choice stands: {_describe(pending.choice or {})}.")
        return resumed
    start = time.perf_counter()
    rank, device = dist.get_rank(), _device_of(batch)  # the rank's device (the module may still be on the CPU)
    accelerator = "cuda" if device.type == "cuda" else "cpu"
    cached, fitted = saved_machine(accelerator) if rank == 0 else (None, False)
    known = saved_costs(module, batch, options.layers) if rank == 0 else None
    decided = [cached is None, known is not None]
    dist.broadcast_object_list(decided, src=0)  # rank 0's cache decides for every rank
    messages = None
    if decided[0] and layout.pp > 1:  # each replica's pipeline times its own; replica 0's counts
        messages = ping_pong(layout.stage_rank(0), layout.stage_rank(1), device, group)
    held = sum(t.nbytes for t in [*module.parameters(), *module.buffers()] if t.device == device)
    base = base_bytes(device, held)  # on a CPU before the profile, which leaves its garbage in the heap
    if decided[1]:
        costs, source = known, "this model's costs measured before on this host"
    else:
        costs, source = _measured_on_every_rank(module, batch, options.layers, options.init_fn)
        return_free_memory(device)
        if device.type == "cuda":  # on a GPU after it, its cache emptied: the kernels and cuBLAS workspaces it
            base = base_bytes(device, held)  # loaded stay for training (198 MiB on an H100, torch 2.11)
    if rank != 0:
        outcome: list[Any] = [None]
    else:
        if not decided[1]:
            save_costs(costs, module, batch, options.layers)
        machine = cached or with_messages(STAND_IN, *(messages or (STAND_IN.latency_s, STAND_IN.bandwidth_bytes_per_s)))
        if cached is None:
            save_machine(machine, accelerator, fitted=False)
        if not fitted:  # the stand-in's base; the calibration job measured its own
            machine = replace(machine, base_bytes=base)
        try:
            outcome = [_plan(costs, source, options, layout, machine, fitted, batch_size_of(batch), device, start)]
        except PipelineConfigError as error:
            outcome = [error]
    dist.broadcast_object_list(outcome, src=0)
    if isinstance(outcome[0], PipelineConfigError):
        raise outcome[0]
    return replace(options, **outcome[0], planned=True)


def _measured_on_every_rank(
    module: nn.Module, batch: Any, layers: str | None, init_fn: InitFn | None
) -> tuple[ModelCosts, str]:
    """The model's costs measured by every rank at once, as ``balance="profile"`` does: each rank's profile then
    shares the memory bandwidth and caches with the others as training will, and their mean is less noisy. A rank
    that could not measure stops every rank with its error, after the one exchange all of them reach."""
    try:
        mine: tuple[ModelCosts, str] | str = _model_costs(module, batch, layers, init_fn)
    except Exception as error:  # noqa: BLE001 (every rank stops with it, none waits for a choice)
        log.exception("Measuring the model for schedule='auto' failed")
        mine = f"{type(error).__name__}: {error}"
    every: list[Any] = [None] * dist.get_world_size()
    dist.all_gather_object(every, mine)
    failed = [(r, e) for r, e in enumerate(every) if isinstance(e, str)]
    if failed:
        rank, error = failed[0]
        raise PipelineConfigError(
            f"schedule='auto' could not measure the model on rank {rank} ({error}); give the schedule, n_microbatches"
            " and balance explicitly, or plan with python -m lightning_pp.plan."
        )
    source = f"{every[0][1]} (the mean of {len(every)} ranks measuring at once)"
    return mean_costs([costs for costs, _ in every]), source


def _resumed(recorded: Mapping[str, Any] | None, options: PipelineOptions, layout: Layout) -> PipelineOptions | None:
    """The options with a resumed checkpoint's choice of what is "auto" now; None (choose again) where it did not
    record one, or its stages do not fit these ranks and the arguments given now."""
    if recorded is None:
        return None
    try:
        resumed = replace(options, **{k: v for k, v in recorded.items() if k in options.auto}, planned=True)
    except PipelineConfigError:
        return None
    counts = resumed.balance
    return None if isinstance(counts, list) and len(counts) != layout.pp * resumed.stages_per_rank else resumed


def recorded_choice(options: PipelineOptions) -> dict[str, Any]:
    """What a checkpoint records of the choice (nothing when nothing was "auto")."""
    if not (options.auto and options.planned):
        return {}
    return {"pipeline_choice": {name: getattr(options, name) for name in CHOSEN}}


def _plan(
    costs: ModelCosts,
    source: str,
    options: PipelineOptions,
    layout: Layout,
    machine: Machine,
    fitted: bool,
    size: int,
    device: torch.device,
    start: float,
) -> dict[str, Any]:
    limit = _limit_mib(options, device, layout)
    ranked = _ranked(costs, machine, options, layout, size, limit)
    if not ranked:
        raise _nothing_fits(options, costs, machine, layout, size, limit)
    best = ranked[0]
    choice = {**_fields(best.config), **({} if "balance" in options.auto else {"balance": options.balance})}
    choice["forecast"] = Forecast(best.step_s, tuple(b / 2**20 for b in best.peak_bytes), limit)
    runner_up = f"; runner-up: {_describe_prediction(ranked[1])}" if len(ranked) > 1 else ""
    action = "measured" if fitted else "this project's CPU figure (python -m lightning_pp.plan measures this machine's)"
    rank_zero_info(
        f"schedule='auto' chose {_describe_prediction(best)}{runner_up}. Planned in {time.perf_counter() - start:.1f} s"
        f" over {len(ranked)} configurations from {source}; the runtime's cost per action was {action}."
    )
    return choice


def _model_costs(module: nn.Module, batch: Any, layers: str | None, init_fn: InitFn | None) -> tuple[ModelCosts, str]:
    """The model's costs, and where they come from: its own step measured on a copy of the batch (the sanity
    check's is made under inference mode) on the rank's device, the module brought there for it (a meta build
    materialised by the name rule, ``init_fn`` if given) when it fits easily; else its FLOPs and operations counted
    without data (see ``_measured_here``)."""
    size, device = batch_size_of(batch), _device_of(batch)
    at, meta = next(module.parameters()).device, any(p.is_meta for p in module.parameters())
    held = sum(t.nbytes for t in [*module.parameters(), *module.buffers()])
    unmade = f" (the module is on the {at.type}, too large to measure on {device})"
    if _measured_here(at, device, held, _free_bytes(device)):
        gpus = range(torch.cuda.device_count()) if torch.cuda.is_initialized() else []
        # brought outside inference mode (the sanity check's), or the weights would come back as inference tensors
        with (
            torch.random.fork_rng(devices=gpus),
            torch.inference_mode(False),
            torch.enable_grad(),
            contextlib.ExitStack() as placed,
        ):
            try:
                placed.enter_context(materialized(module, device, init_fn))
            except PipelineConfigError as error:  # an initialiser missing, which a pretrained checkpoint stands for
                unmade = f" ({type(module).__name__} could not be materialised for a profile: {error})"
            else:
                copy = tree_map(lambda t: t.to(device, copy=True) if isinstance(t, torch.Tensor) else t, batch)
                costs = profile_module(module, copy, layers, profiled_sizes(size))
                brought = "" if at == device else f" on the module {'materialised on' if meta else 'moved to'} {device}"
                return costs, f"the first batch's costs{brought}"
    speed = device_speed(device, next(module.parameters()).dtype)
    costs = counted_costs(module, batch, layers, profiled_sizes(size), speed, device)
    return costs, (
        f"the first batch's FLOPs and operations counted on fake tensors{unmade} at {speed.flops_per_s / 1e9:.0f}"
        f" GFLOP/s and {speed.seconds_per_op * 1e6:.1f} us an operation"
    )


def _measured_here(at: torch.device, device: torch.device, nbytes: int, free: int) -> bool:
    """Time the model on the rank's ``device``, where it will train: a module built elsewhere (on the CPU for a GPU
    run, or on meta) is brought there for the profile when six times its ``nbytes`` (weights, gradients, Adam's two
    states and the step's activations, a guess) fit in half the ``free`` bytes. Timed on the CPU instead, a model's
    costs would be the CPU's (and take it minutes); one too large is costed by its FLOPs and operations."""
    return at == device or 12 * nbytes <= free


def _free_bytes(device: torch.device) -> int:
    """What a rank may take of ``device``'s free memory; on a CPU, an equal share of the host's, every rank
    measuring at once."""
    if device.type == "cuda":
        return torch.cuda.mem_get_info(device)[0]
    return proc_bytes("MemAvailable:", "/proc/meminfo") // dist.get_world_size()  # 0 where not Linux: counted


def _choices(options: PipelineOptions, layout: Layout, size: int) -> dict[str, Any]:
    """``planner.configurations``' narrowing: the ranks as given, each argument given kept."""
    auto = options.auto
    schedules = (
        [s for s in SCHEDULES if s not in ASYNC and _accepts(options, s)] if "schedule" in auto else [options.schedule]
    )
    fixed_m = options.n_microbatches or default_microbatches(size, options.schedule, layout.pp, layout.n_stages)
    return {
        "schedules": schedules,
        "pipeline_sizes": [layout.pp],
        "stages_per_rank": (2, 4) if "stages_per_rank" in auto else (options.stages_per_rank,),
        "microbatches": None if "n_microbatches" in auto else [fixed_m],
        "activation_checkpointing": (False, True)
        if "activation_checkpointing" in auto
        else (options.activation_checkpointing,),
        "data_parallel": (options.data_parallel,),
    }


def _accepts(options: PipelineOptions, schedule: str) -> bool:
    """The other arguments work with ``schedule`` (compile refuses the split-backward schedules, ...)."""
    try:
        replace(options, schedule=schedule, stages_per_rank=None, memory_limit=None, auto=frozenset())
    except PipelineConfigError:
        return False
    return True


def _keeps(prediction: Prediction, options: PipelineOptions) -> bool:
    """A prediction that honours what was given (the stages per rank, a balance mode or list) and, for a count
    chosen, at most 4 micro-batches per stage, the default's range: below that, micro-batches of a sample or two
    are where the prediction is least reliable (the per-action costs dominate; measured: one noisy profile once
    chose 32 micro-batches of one sample for the GPT, predicted 0.19 s, run at 1.04 s, benchmarks/auto.py)."""
    config = prediction.config
    stages = config.pipeline_parallel_size * config.stages_per_rank
    if "n_microbatches" in options.auto and config.n_microbatches > 4 * stages:
        return False
    if "stages_per_rank" not in options.auto and "schedule" in options.auto and options.stages_per_rank:
        if config.stages_per_rank != options.stages_per_rank:
            return False
    if "balance" in options.auto:
        return True
    if isinstance(options.balance, (list, tuple)):
        return len(options.balance) == len(config.balance)
    return config.balance_mode == ("profile" if options.balance == "profile" else "uniform")


def _limit_mib(options: PipelineOptions, device: torch.device, layout: Layout) -> float | None:
    if options.memory_limit is None:
        return None
    if torch.device(device).type == "cuda":
        total = torch.cuda.get_device_properties(device).total_memory
    else:  # the host's memory, shared by its ranks
        total = os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES") // int(os.environ.get("LOCAL_WORLD_SIZE", 1))
    return memory_limit_bytes(options.memory_limit, total) / 2**20


def _nothing_fits(
    options: PipelineOptions, costs: ModelCosts, machine: Machine, layout: Layout, size: int, limit: float | None
) -> PipelineConfigError:
    every = _ranked(costs, machine, options, layout, size, None)
    if limit is None or not every:
        given = _describe({k: getattr(options, k) for k in CHOSEN if k not in options.auto})
        return PipelineConfigError(
            f"schedule='auto' found no configuration torch accepts for a batch of {size} on {layout.pp} pipeline"
            f" ranks with the arguments given ({given}). Give the schedule and micro-batches explicitly."
        )
    least = min(every, key=lambda p: p.peak_mib)
    return PipelineConfigError(
        f"memory_limit={options.memory_limit!r} ({limit:.0f} MiB per rank): no layout is predicted to fit; the"
        f" smallest predicted peak is {least.peak_mib:.0f} MiB ({_describe_prediction(least)}). Raise the limit,"
        " add pipeline ranks, or shard the stages (data_parallel='fsdp')."
    )


def _ranked(
    costs: ModelCosts, machine: Machine, options: PipelineOptions, layout: Layout, size: int, limit: float | None
) -> list[Prediction]:
    """Every configuration for these ranks that honours what was given, best first (under ``limit`` MiB)."""
    every = plan(costs, machine, layout.pp * layout.dp, size, limit, **_choices(options, layout, size))
    return [p for p in every if _keeps(p, options)]


def _fields(config: Config) -> dict[str, Any]:
    """The strategy's arguments that run ``config``."""
    return {name: list(config.balance) if name == "balance" else getattr(config, name) for name in CHOSEN}


def _describe_prediction(p: Prediction) -> str:
    return f"{_describe(_fields(p.config))} (predicted step {p.step_s:.3f} s, peak {p.peak_mib:.0f} MiB per rank)"


def _describe(fields: Mapping[str, Any]) -> str:
    return ", ".join(f"{k}={v!r}" for k, v in fields.items())


def _device_of(batch: Any) -> torch.device:
    """The rank's device: where Lightning put the batch."""
    return next((t.device for t in tree_flatten(batch)[0] if isinstance(t, torch.Tensor)), torch.device("cpu"))
