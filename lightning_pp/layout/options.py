"""The strategy's arguments, normalised and checked once into one frozen object.

``PipelineStrategy.__init__`` builds it on every rank before any process group exists, so a value that
cannot work fails everywhere with the same message and no rank waits in a collective. The wings read
its fields and never normalise or check them again: a schedule name here is canonical.
"""

from __future__ import annotations

import os
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass
from datetime import timedelta
from typing import Any, Literal, Optional, Union

from lightning.fabric.plugins.collectives.torch_collective import default_pg_timeout
from torch import nn

from lightning_pp.errors import PipelineConfigError
from lightning_pp.layout.replica_groups import FaultTolerance, as_fault_tolerance, refusals
from lightning_pp.layout.schedule import (
    ASYNC,
    SPLIT_BACKWARD,
    check_microbatches,
    default_microbatches,
    normalize_schedule,
    resolve_stages_per_rank,
)

Balance = Union[None, str, Sequence[int]]
BALANCE_MODES = ("uniform", "parameters", "profile", "auto")
AUTO = "auto"
Auto = Literal["auto"]  # in the signatures, so LightningCLI (jsonargparse) takes n_microbatches=auto
# the arguments "auto" leaves to the first batch, and what stands in for them until then
_CHOSEN = ("schedule", "n_microbatches", "balance", "stages_per_rank", "activation_checkpointing")
MemoryLimit = Union[None, int, float, str]  # bytes, or "80%" of the device's memory
DataParallel = Literal["ddp", "fsdp"]
Reshard = Literal["step", "microbatch"]
Split = Literal["prune", "trace"]
StateDictType = Literal["full", "sharded"]
# init_fn(module, qualified_name): initialises one module's own tensors after materialisation
InitFn = Callable[[nn.Module, str], None]
# microbatch_weight(micro_batch) -> weight of its loss (e.g. its label tokens)
MicrobatchWeight = Callable[[Any], Any]
# init_weights_keys(name) -> the pretrained checkpoint's key of a tensor, or None: left to its initialiser
KeyFn = Callable[[str], Optional[str]]


@dataclass(frozen=True)
class Forecast:
    """What ``schedule="auto"`` predicted of its choice: seconds a step, peak MiB per pipeline rank, and the
    ``memory_limit`` it was held under (MiB per rank; None without one)."""

    step_s: float
    peak_mib: tuple[float, ...]
    limit_mib: Optional[float] = None


@dataclass(frozen=True)
class PipelineOptions:
    """What ``PipelineStrategy(...)`` was given, in its order, normalised: a canonical schedule name, the
    stages each rank holds, the timeout as a ``timedelta`` (README's table says what each argument means)."""

    schedule: str = "1f1b"
    n_microbatches: Union[int, Auto, None] = None
    pipeline_parallel_size: Optional[int] = None
    layers: Optional[str] = None
    balance: Balance = None
    stages_per_rank: Union[int, Auto, None] = None
    activation_checkpointing: Union[bool, Auto] = False
    state_dict_type: StateDictType = "full"
    split: Optional[Split] = None
    data_parallel: DataParallel = "ddp"
    fsdp_reshard: Reshard = "step"
    tensor_parallel_size: int = 1
    expert_parallel_size: int = 1
    microbatch_weight: Optional[MicrobatchWeight] = None
    init_fn: Optional[InitFn] = None
    init_weights: Optional[Union[str, os.PathLike]] = None
    init_weights_keys: Optional[KeyFn] = None
    timeout: Optional[Union[timedelta, float]] = None
    process_group_backend: Optional[str] = None
    async_save: bool = False
    init_adapter: Optional[Union[str, os.PathLike]] = None
    save_frozen: bool = False
    compile: Union[bool, Mapping[str, Any], None] = False
    memory_limit: MemoryLimit = None
    checksums: bool = True  # sharded saves record each file's size and block CRC-32s, checked at every load
    fault_tolerance: Union[FaultTolerance, Mapping[str, Any], None] = None  # torchft replica groups
    auto: frozenset[str] = frozenset()  # the arguments given as "auto", chosen at the first batch
    planned: bool = False  # they have been chosen (the fields hold the choice)
    forecast: Optional[Forecast] = None  # what the choice was predicted to cost, checked against the first steps

    def __post_init__(self) -> None:
        _stand_in_for_auto(self)
        schedule = normalize_schedule(self.schedule)
        if self.n_microbatches is not None:
            check_microbatches(schedule, int(self.n_microbatches), 1, 1)
        _check_choice("state_dict_type", self.state_dict_type, _STATE_DICT_TYPES)
        if isinstance(self.balance, str):
            check_balance_mode(self.balance)
        if self.split is not None:
            _check_choice("split", self.split, _SPLITS)
        _check_choice("data_parallel", self.data_parallel, _DATA_PARALLEL)
        _check_choice("fsdp_reshard", self.fsdp_reshard, _RESHARD)
        for size in ("tensor_parallel_size", "expert_parallel_size"):
            if int(getattr(self, size)) < 1:
                raise PipelineConfigError(f"{size}={getattr(self, size)} must be a positive integer.")
        timeout = self.timeout
        normal = {
            "schedule": schedule,
            "n_microbatches": None if self.n_microbatches is None else int(self.n_microbatches),
            "stages_per_rank": resolve_stages_per_rank(schedule, self.stages_per_rank),
            "activation_checkpointing": bool(self.activation_checkpointing),
            "tensor_parallel_size": int(self.tensor_parallel_size),
            "expert_parallel_size": int(self.expert_parallel_size),
            "compile": _compile_options(self.compile),
            "timeout": timedelta(seconds=timeout)
            if isinstance(timeout, (int, float))
            else timeout or default_pg_timeout,
            "fault_tolerance": as_fault_tolerance(self.fault_tolerance),
        }
        for name, value in normal.items():
            object.__setattr__(self, name, value)
        _check_combinations(self)

    @property
    def split_backward(self) -> bool:
        """The schedule computes input and weight gradients in two halves (zero-bubble and V schedules)."""
        return self.schedule in SPLIT_BACKWARD

    @property
    def given_microbatches(self) -> Optional[int]:
        """``n_microbatches`` as the user gave it: a chosen count is the first batch's, not every batch's."""
        return None if "n_microbatches" in self.auto else self.n_microbatches

    @property
    def asynchronous(self) -> bool:
        """PipeDream-2BW: no flush between steps."""
        return self.schedule in ASYNC

    @property
    def traceable(self) -> bool:
        """``split="trace"`` works with the other arguments (see ``_check_combinations``)."""
        microbatch_fsdp = self.data_parallel == "fsdp" and self.fsdp_reshard == "microbatch"
        return self.tensor_parallel_size == 1 and not microbatch_fsdp and not self.asynchronous


def microbatches_for(o: PipelineOptions, batch_size: int, pp: int, n_stages: int) -> int:
    """``n_microbatches``, or by default ``default_microbatches``' count for this batch size (also for a
    batch that the count "auto" chose does not divide: the last, partial one)."""
    m = o.n_microbatches
    if m is not None and (o.given_microbatches is not None or batch_size % m == 0):
        return m
    return default_microbatches(batch_size, o.schedule, pp, n_stages)


def _stand_in_for_auto(o: PipelineOptions) -> None:
    """Until the first batch chooses, the arguments given as "auto" hold what the strategy's set-up can run on (one
    stage per rank under 1F1B unless the stages per rank were given); ``auto`` names them. With the schedule
    chosen, so are the micro-batches, stages per rank and balance left unset."""
    auto = o.auto | {name for name in _CHOSEN if getattr(o, name) == AUTO}
    if o.schedule == AUTO:
        auto |= {name for name in ("n_microbatches", "stages_per_rank", "balance") if getattr(o, name) is None}
    given_stages = o.stages_per_rank not in (None, AUTO) and int(o.stages_per_rank) > 1  # type: ignore[arg-type]
    stand_ins = {"schedule": "interleaved_1f1b" if given_stages else "1f1b", "n_microbatches": None, "balance": None,
                 "stages_per_rank": None, "activation_checkpointing": False}  # fmt: skip
    for name in _CHOSEN:
        if getattr(o, name) == AUTO:
            object.__setattr__(o, name, stand_ins[name])
    object.__setattr__(o, "auto", frozenset(auto))
    if o.memory_limit is not None:
        memory_limit_bytes(o.memory_limit, 1)  # checked now, resolved against the device at the first batch
        if not auto:
            raise PipelineConfigError(
                f"memory_limit={o.memory_limit!r} with nothing to choose: it bounds the layout that schedule='auto'"
                " (or balance='auto', n_microbatches='auto', ...) picks. Give one of them as 'auto', or leave"
                " memory_limit out."
            )
    if auto and (o.tensor_parallel_size > 1 or o.expert_parallel_size > 1):
        raise PipelineConfigError(
            f"{sorted(auto)} given as 'auto' with tensor_parallel_size={o.tensor_parallel_size} and"
            f" expert_parallel_size={o.expert_parallel_size}: the planner does not model tensor or expert"
            " parallelism yet. Give the schedule, micro-batches and balance explicitly with them."
        )


def memory_limit_bytes(limit: MemoryLimit, device_bytes: int) -> int:
    """``memory_limit`` in bytes: a number of bytes, or a share of ``device_bytes`` such as "80%"."""
    if isinstance(limit, str) and limit.strip().endswith("%"):
        try:
            share = float(limit.strip()[:-1]) / 100
        except ValueError:
            share = -1.0
        if 0 < share <= 1:
            return int(share * device_bytes)
    elif isinstance(limit, (int, float)) and not isinstance(limit, bool) and limit > 0:
        return int(limit)
    raise PipelineConfigError(
        f"memory_limit={limit!r}: give the bytes a rank may hold (e.g. 40 * 2**30) or a share of the device's"
        " memory such as '80%'."
    )


def check_balance_mode(balance: str) -> None:
    """Reject an unknown mode when the strategy is built, not at the first batch."""
    if balance.lower() not in BALANCE_MODES:
        raise PipelineConfigError(
            f"Unknown balance={balance!r}. Use one of {list(BALANCE_MODES)} or a list of layer counts per stage"
            " such as [3, 5]."
        )


_STATE_DICT_TYPES = {
    "full": "one .ckpt file gathered on rank 0",
    "sharded": "a directory written by every rank with torch.distributed.checkpoint",
}
_SPLITS = {
    "prune": "the user's forward on a module pruned to the stage, skipping None parts",
    "trace": "torch's pipeline tracer splits the model at its layers",
}
_DATA_PARALLEL = {
    "ddp": "each replica holds its whole stage",
    "fsdp": "FSDP2 shards each stage's parameters, gradients and optimizer state over its replicas",
}
_RESHARD = {
    "step": "a stage stays unsharded during a step: least communication",
    "microbatch": "parameters resharded and gradients reduce-scattered after every micro-batch: least memory",
}


def _check_choice(argument: str, value: str, choices: dict[str, str]) -> None:
    if value not in choices:
        use = " or ".join(f"{name!r} ({why})" for name, why in choices.items())
        raise PipelineConfigError(f"Unknown {argument}={value!r}; use {use}.")


def _check_combinations(o: PipelineOptions) -> None:
    """Arguments that work alone but not together."""
    weighted = o.microbatch_weight is not None
    why = refusals(o.fault_tolerance, o.schedule, o.auto, weighted)  # type: ignore[arg-type]
    if why is not None:
        raise PipelineConfigError(f"{why}.")
    if o.async_save and o.state_dict_type != "sharded":
        raise PipelineConfigError(
            f"async_save=True with state_dict_type={o.state_dict_type!r}: a save runs in the background as each"
            " rank's own shard (torch.distributed.checkpoint.async_save). Set state_dict_type='sharded'."
        )
    if o.data_parallel == "fsdp" and o.fsdp_reshard == "microbatch" and o.split_backward:
        raise PipelineConfigError(
            f"fsdp_reshard='microbatch' with schedule={o.schedule!r}: the zero-bubble and V schedules split each"
            " backward into an input and a weight half, between which FSDP would reshard the weights. Use"
            " fsdp_reshard='step' with this schedule, or schedule='1f1b', 'gpipe' or 'interleaved_1f1b'."
        )
    if o.split == "trace" and o.tensor_parallel_size > 1:
        raise PipelineConfigError(
            f"split='trace' with tensor_parallel_size={o.tensor_parallel_size}: a tensor-parallel plan is applied"
            " to the user's modules in configure_model, which the traced pieces do not run. Use split='prune' with"
            " tensor parallelism."
        )
    if o.split == "trace" and o.data_parallel == "fsdp" and o.fsdp_reshard == "microbatch":
        raise PipelineConfigError(
            "split='trace' with fsdp_reshard='microbatch' is not supported yet: the traced pieces call none of the"
            " user's modules, whose FSDP units would reshard after each of them. Use fsdp_reshard='step' with"
            " split='trace', or split='prune'."
        )
    common = {
        "data_parallel='fsdp'": o.data_parallel == "fsdp",
        f"tensor_parallel_size={o.tensor_parallel_size}": o.tensor_parallel_size > 1,
    }
    if o.expert_parallel_size > 1:
        _refuse_with(
            f"expert_parallel_size={o.expert_parallel_size}",
            {**common, "schedule='2bw'": o.asynchronous},
            "the experts are sharded over the replicas, which DDP (data_parallel='ddp') averages the other weights"
            " over. Use expert_parallel_size=1 with it",
        )
    if o.compile is not None and o.split_backward:
        raise PipelineConfigError(
            f"compile=True with schedule={o.schedule!r}: the zero-bubble and V schedules split each backward into an"
            " input and a weight half, which compiled graphs do not support yet (pytorch#161904; torchtitan turns"
            " them off with compile). Use schedule='gpipe', '1f1b' or 'interleaved_1f1b' with compile=True, or this"
            " schedule without it."
        )
    if o.asynchronous:
        _refuse_with(
            "schedule='2bw'",
            {
                **common,
                "split='trace'": o.split == "trace",
                "activation_checkpointing=True": o.activation_checkpointing,
                "compile=True": o.compile is not None,
            },
            "the weight versions are bound on the user's own modules, one copy per replica. Use schedule='1f1b' with"
            " it, or 2BW without it",
        )


_COMPILE_OPTIONS = ("fullgraph", "dynamic", "backend", "mode", "options")


def _compile_options(given: bool | Mapping[str, Any] | None) -> dict[str, Any] | None:
    """``compile``: None (off), or the keyword arguments ``torch.compile`` gets for each layer."""
    if given is None or given is False:
        return None
    if given is True:
        return {}
    unknown = sorted(set(given) - set(_COMPILE_OPTIONS))
    if unknown:
        raise PipelineConfigError(
            f"compile={dict(given)!r}: {unknown} are not torch.compile arguments a layer takes; use True, or a dict"
            f" of {list(_COMPILE_OPTIONS)} (e.g. {{'mode': 'max-autotune-no-cudagraphs'}})."
        )
    return dict(given)


def _refuse_with(argument: str, others: dict[str, bool], why: str) -> None:
    """``argument`` with the first of ``others`` given: not supported yet, ``why``."""
    for what, given in others.items():
        if given:
            raise PipelineConfigError(f"{argument} with {what} is not supported yet: {why}.")
