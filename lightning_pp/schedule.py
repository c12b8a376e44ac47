"""Schedule names, micro-batch counts and the checks that must pass before any rank communicates."""

from __future__ import annotations

from torch.distributed.pipelining import Schedule1F1B, ScheduleGPipe
from torch.distributed.pipelining.schedules import PipelineScheduleSingle

from lightning_pp.errors import PipelineConfigError

SCHEDULES: dict[str, type[PipelineScheduleSingle]] = {"gpipe": ScheduleGPipe, "1f1b": Schedule1F1B}
# Schedules torch offers that need several stages per rank; they arrive with issue 7.
PLANNED_SCHEDULES = ("interleaved_1f1b", "looped_bfs", "interleaved_zb", "zbv", "dualpipev")
# Schedules whose first pipeline rank must run every micro-batch forward before the last one starts
# its backward need at least as many micro-batches as stages.
_NEEDS_M_GE_STAGES = {"1f1b"}


def normalize_schedule(name: str) -> str:
    """The canonical schedule name; unknown names list the valid ones."""
    key = str(name).lower().replace("-", "_")
    key = {"schedule1f1b": "1f1b", "schedulegpipe": "gpipe"}.get(key, key)
    if key in SCHEDULES:
        return key
    if key in PLANNED_SCHEDULES:
        raise NotImplementedError(
            f"schedule={name!r} is planned (issue 7: multi-stage schedules) and not available yet;"
            f" use one of {sorted(SCHEDULES)}."
        )
    raise PipelineConfigError(f"Unknown schedule={name!r}; valid schedules are {sorted(SCHEDULES)} (case-insensitive).")


def schedule_class(name: str) -> type[PipelineScheduleSingle]:
    return SCHEDULES[normalize_schedule(name)]


def default_microbatches(batch_size: int, n_stages: int) -> int:
    """The largest divisor of the batch size in [stages, 4 x stages]: fills the pipeline, keeps micro-batches big."""
    for m in range(min(batch_size, 4 * n_stages), n_stages - 1, -1):
        if batch_size % m == 0:
            return m
    raise PipelineConfigError(
        f"Cannot choose n_microbatches for a batch of {batch_size} samples on {n_stages} stages: no divisor of"
        f" {batch_size} lies between {n_stages} and {4 * n_stages}. Set PipelineStrategy(n_microbatches=...)"
        f" or use a batch size that is a multiple of {n_stages}."
    )


def check_microbatches(schedule: str, n_microbatches: int, n_stages: int) -> None:
    if n_microbatches < 1:
        raise PipelineConfigError(f"n_microbatches={n_microbatches} must be a positive integer.")
    if normalize_schedule(schedule) in _NEEDS_M_GE_STAGES and n_microbatches < n_stages:
        raise PipelineConfigError(
            f"schedule={schedule!r} needs n_microbatches >= stages, but n_microbatches={n_microbatches} and there"
            f" are {n_stages} stages; use n_microbatches={n_stages} or more, or schedule='gpipe'."
        )


def check_batch_size(batch_size: int, n_microbatches: int, where: str = "A batch") -> None:
    """Every micro-batch must be equally large, or a rank crashes mid-schedule and its peers hang."""
    if batch_size < n_microbatches or batch_size % n_microbatches:
        raise PipelineConfigError(
            f"{where} has {batch_size} samples, which does not split into n_microbatches={n_microbatches} equal"
            f" parts. Use a batch size that is a multiple of {n_microbatches}, pass drop_last=True to the"
            f" DataLoader, or choose an n_microbatches that divides {batch_size}."
        )
