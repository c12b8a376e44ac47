"""Schedule names, stage placement, micro-batch counts and the checks that must pass before any rank communicates."""

from __future__ import annotations

from typing import Any

from torch.distributed.pipelining import (
    Schedule1F1B,
    ScheduleDualPipeV,
    ScheduleGPipe,
    ScheduleInterleaved1F1B,
    ScheduleInterleavedZeroBubble,
    ScheduleLoopedBFS,
    ScheduleZBVZeroBubble,
)
from torch.distributed.pipelining.schedules import (
    _Action,
    _add_send_recv,
    _add_unshard_reshard,
    _ComputationType,
    _PipelineSchedule,
    _PipelineScheduleRuntime,
)
from torch.utils._pytree import tree_flatten

from lightning_pp.compat import with_send_waits
from lightning_pp.errors import PipelineConfigError

SCHEDULES: dict[str, type[_PipelineSchedule]] = {
    "gpipe": ScheduleGPipe,
    "1f1b": Schedule1F1B,
    "interleaved_1f1b": ScheduleInterleaved1F1B,
    "looped_bfs": ScheduleLoopedBFS,
    "interleaved_zb": ScheduleInterleavedZeroBubble,
    "zbv": ScheduleZBVZeroBubble,
    "dualpipev": ScheduleDualPipeV,
}
# PipeDream-2BW (lightning_pp.runtime.twobw): our stream over torch's PipelineStage, no flush between steps
ASYNC = ("2bw",)
# one stage per rank; the others take a list of stages
SINGLE_STAGE = ("gpipe", "1f1b", *ASYNC)
# two stages per rank placed as a V, (r, 2p-1-r): the last stage, and so the loss, sits on pipeline rank 0
V_SHAPED = ("zbv", "dualpipev")
# zero-bubble schedules compute weight gradients with autograd.grad, past DDP's hooks: DDP would not
# average them over replicas (torch 2.13), so the gradients of these are averaged after the step
SPLIT_BACKWARD = ("interleaved_zb", "zbv", "dualpipev")
_ALIASES = {
    **{cls.__name__.lower(): name for name, cls in SCHEDULES.items()},
    # torch.distributed.pipelining.get_schedule_class's names
    "interleaved1f1b": "interleaved_1f1b",
    "loopedbfs": "looped_bfs",
    "interleavedzerobubble": "interleaved_zb",
    "zbvzerobubble": "zbv",
    "pipedream_2bw": "2bw",
}


def normalize_schedule(name: str) -> str:
    """The canonical schedule name (torch's class and registry names work too); unknown names list the valid ones."""
    key = str(name).lower().replace("-", "_")
    key = _ALIASES.get(key, _ALIASES.get(key.replace("_", ""), key))
    if key in SCHEDULES or key in ASYNC:
        return key
    raise PipelineConfigError(
        f"Unknown schedule={name!r}; valid schedules are {[*SCHEDULES, *ASYNC]} (case-insensitive)."
    )


def resolve_stages_per_rank(schedule: str, stages_per_rank: int | None) -> int:
    """Stages each rank holds: 1 for GPipe and 1F1B, 2 for the V schedules, by default 2 for the looped ones."""
    name = normalize_schedule(schedule)
    default = 1 if name in SINGLE_STAGE else 2
    count = default if stages_per_rank is None else int(stages_per_rank)
    if name in SINGLE_STAGE and count != 1:
        raise PipelineConfigError(
            f"schedule={schedule!r} runs one stage per rank, but stages_per_rank={stages_per_rank}; use"
            f" schedule='interleaved_1f1b' (or 'looped_bfs', 'interleaved_zb') for several stages per rank."
        )
    if name in V_SHAPED and count != 2:
        raise PipelineConfigError(
            f"schedule={schedule!r} places exactly two stages per rank (a V), but stages_per_rank={stages_per_rank};"
            " use stages_per_rank=2 or leave it unset."
        )
    if count < 1:
        raise PipelineConfigError(f"stages_per_rank={stages_per_rank} must be a positive integer.")
    return count


def stages_of_rank(schedule: str, pp_rank: int, pp: int, stages_per_rank: int) -> list[int]:
    """The stages pipeline rank ``pp_rank`` holds: loop placement (stage s on rank s % pp) or a V."""
    if normalize_schedule(schedule) in V_SHAPED:
        return _v_stages(pp_rank, pp)
    return [pp_rank + k * pp for k in range(stages_per_rank)]


def rank_of_stage(schedule: str, stage: int, pp: int) -> int:
    """The pipeline rank that holds ``stage`` (the inverse of ``stages_of_rank``)."""
    if normalize_schedule(schedule) in V_SHAPED:
        return _v_rank(stage, pp)
    return stage % pp


def _v_stages(pp_rank: int, pp: int) -> list[int]:
    return [pp_rank, 2 * pp - 1 - pp_rank]


def _v_rank(stage: int, pp: int) -> int:
    return stage if stage < pp else 2 * pp - 1 - stage


def default_microbatches(batch_size: int, schedule: str, pp: int, n_stages: int) -> int:
    """The largest divisor of the batch size in [stages, 4 x stages] that the schedule accepts: fills the
    pipeline, keeps micro-batches big. A batch without one (a last, partial batch; a prime size) takes the divisor
    nearest that range: the smallest above it, else the largest below it, which ``schedule_for`` runs in an order
    that takes fewer micro-batches than stages. Refusing such a batch stopped a fit whose validation set was not a
    multiple of the batch size."""
    accepted = [m for m in range(1, batch_size + 1) if batch_size % m == 0 and _accepts(schedule, m, pp, n_stages)]
    inside = [m for m in accepted if n_stages <= m <= 4 * n_stages]
    above, below = [m for m in accepted if m > 4 * n_stages], [m for m in accepted if m < n_stages]
    if inside or above or below:
        return max(inside) if inside else min(above) if above else max(below)
    raise PipelineConfigError(
        f"Cannot choose n_microbatches for a batch of {batch_size} samples on {n_stages} stages: schedule={schedule!r}"
        f" accepts no divisor of {batch_size}. Set PipelineStrategy(n_microbatches=...) or use a batch size that is"
        f" a multiple of {n_stages}."
    )


def schedule_for(schedule: str, n_microbatches: int, n_stages: int) -> str:
    """The schedule a batch of ``n_microbatches`` runs: 1F1B and DualPipeV need a micro-batch per stage, so a batch
    split into fewer runs the same stages in GPipe's and ZBV's order (the same forwards and backwards, each
    micro-batch's gradients added in the same order)."""
    return _FEWER.get(schedule, schedule) if n_microbatches < n_stages else schedule


_FEWER = {"1f1b": "gpipe", "dualpipev": "zbv"}


def _accepts(schedule: str, m: int, pp: int, n_stages: int) -> bool:
    try:
        check_microbatches(schedule_for(schedule, m, n_stages), m, pp, n_stages)
    except PipelineConfigError:
        return False
    return True


def check_microbatches(schedule: str, n_microbatches: int, pp: int, n_stages: int) -> None:
    """torch's own constraints on the micro-batch count, raised on every rank before the first step.

    ``pp`` is the number of pipeline ranks, ``n_stages`` the number of stages (pp x stages per rank).
    """
    name = normalize_schedule(schedule)
    m = n_microbatches
    if m < 1:
        raise PipelineConfigError(f"n_microbatches={m} must be a positive integer.")
    if name in ("1f1b", *ASYNC) and m < n_stages:
        raise PipelineConfigError(
            f"schedule={schedule!r} needs n_microbatches >= stages, but n_microbatches={m} and there"
            f" are {n_stages} stages; use n_microbatches={n_stages} or more, or schedule='gpipe'."
        )
    if name == "dualpipev" and m < n_stages:
        raise PipelineConfigError(
            f"schedule={schedule!r} needs n_microbatches >= stages (2 per rank), but n_microbatches={m} and"
            f" there are {n_stages} stages; use n_microbatches={n_stages} or more."
        )
    if name in ("interleaved_1f1b", "interleaved_zb"):
        rounds = max(1, m // pp)
        if m % rounds:
            fits = [k for k in range(pp, 4 * pp + 1) if k % max(1, k // pp) == 0]
            raise PipelineConfigError(
                f"schedule={schedule!r} runs micro-batches in rounds of {pp} (the pipeline ranks), so"
                f" n_microbatches={m} must be a multiple of its {rounds} rounds; use one of {fits} or a multiple"
                f" of {pp}."
            )


def check_batch_size(batch_size: int, n_microbatches: int, where: str = "A batch") -> None:
    """Every micro-batch must be equally large, or a rank crashes mid-schedule and its peers hang."""
    if batch_size < n_microbatches or batch_size % n_microbatches:
        raise PipelineConfigError(
            f"{where} has {batch_size} samples, which does not split into n_microbatches={n_microbatches} equal"
            f" parts. Use a batch size that is a multiple of {n_microbatches}, pass drop_last=True to the"
            f" DataLoader, or choose an n_microbatches that divides {batch_size}."
        )


def check_loaders(
    kind: str,
    loaders: Any,
    limits: list[int | float],
    n_microbatches: int | None,
    schedule: str,
    pp: int,
    n_stages: int,
) -> None:
    """Report batches that cannot be split, before any rank starts the schedule (where a loader's length is known)."""

    def check_split(size: int, where: str) -> None:
        if n_microbatches is not None:
            check_batch_size(size, n_microbatches, where)
            return
        try:
            default_microbatches(size, schedule, pp, n_stages)
        except PipelineConfigError as error:
            raise PipelineConfigError(f"{where}: {error}") from None

    for i, loader in enumerate(tree_flatten(loaders)[0]):
        size = getattr(loader, "batch_size", None)
        if not isinstance(size, int):
            continue
        check_split(size, f"The {kind} DataLoader's batch_size={size}")
        try:
            samples = len(loader.sampler)
        except TypeError:
            continue
        last = samples % size
        reached = i >= len(limits) or limits[i] >= -(-samples // size)
        if last and reached and not getattr(loader, "drop_last", False):
            check_split(last, f"The last {kind} batch ({samples} samples, batch_size={size})")


def build_schedule(name: str, stages: list[Any], n_microbatches: int, loss_fn: Any, train: bool) -> _PipelineSchedule:
    """torch's schedule over this rank's stages; the loss scale is ours, so torch does not scale gradients.

    torch 2.13's schedules cannot run forward-only where one rank holds two adjacent stages (a V; any
    multi-stage schedule on one pipeline rank): their forward steals backward inputs ("can't
    steal_bwd_input"), so evaluation there runs the same stages with torch's runtime in plain forward
    order instead.
    """
    name = schedule_for(normalize_schedule(name), n_microbatches, stages[0].num_stages)
    if not train and (name in V_SHAPED or (stages[0].group_size == 1 and len(stages) > 1)):
        return _ForwardOnly(name, stages, n_microbatches, loss_fn=loss_fn, scale_grads=False)
    if name in SINGLE_STAGE:
        (stage,) = stages
        return SCHEDULES[name](stage, n_microbatches, loss_fn=loss_fn, scale_grads=False)
    return SCHEDULES[name](stages, n_microbatches, loss_fn=loss_fn, scale_grads=False)


class _ForwardOnly(_PipelineScheduleRuntime):
    """Every rank runs its first stage's micro-batches, then its next's: no rank waits on a later one."""

    def __init__(self, schedule: str, *args: Any, **kwargs: Any) -> None:
        super().__init__(*args, **kwargs)
        pp, n = self.pp_group_size, self._num_stages
        mapping = {s: rank_of_stage(schedule, s, pp) for s in range(n)}
        self.stage_index_to_group_rank = mapping
        for stage in self._stages:
            stage.stage_index_to_group_rank = mapping
        forward = _ComputationType.FORWARD
        # UNSHARD/RESHARD around each stage's forwards: an FSDP-sharded stage is gathered before it computes
        self.pipeline_order = {
            r: _add_unshard_reshard(
                [_Action(s, forward, mb) for s in range(n) if mapping[s] == r for mb in range(self._n_microbatches)]
            )
            for r in range(pp)
        }
        self.pipeline_order_with_comms = with_send_waits(
            _add_send_recv(self.pipeline_order, stage_to_rank=lambda s: mapping[s], num_stages=n)
        )


def keep_loader_order(trainer: Any) -> bool:
    """One pipeline replica draws its loaders as the user made them: Lightning's injected sampler would shuffle
    even ``shuffle=False`` loaders (as under DDP). Whether it would have been injected (a random sampler is then
    seeded alike on every stage: ``split.microbatch.seeded_shuffle``)."""
    connector = trainer._accelerator_connector
    injected, connector.use_distributed_sampler = connector.use_distributed_sampler, False
    return bool(injected)
