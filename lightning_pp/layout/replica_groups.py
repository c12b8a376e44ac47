"""``fault_tolerance``: which torchft replica group this pipeline job is, and where its lighthouse is.

Each replica group is a pipeline job of its own (its own torchrun or SLURM step); the groups meet in a
lighthouse every step, average their gradients stage with stage and leave a dead group out of the next
step (``lightning_pp.replicas``). Checked here, on every rank before any process group exists, so a
setting that cannot be exact fails everywhere with the same message.
"""

from __future__ import annotations

from dataclasses import dataclass, fields
from typing import Any, Mapping, Optional, Union
from urllib.parse import urlparse

from lightning_pp.errors import PipelineConfigError


@dataclass(frozen=True)
class FaultTolerance:
    """``PipelineStrategy(fault_tolerance=FaultTolerance(...))`` or the same keys as a dict.

    ``lighthouse``: the address ``torchft_lighthouse --bind`` serves (``http://host:port``; None reads
    ``TORCHFT_LIGHTHOUSE``). ``group``: this group's id, 0 to ``groups - 1``, also its share of the data.
    ``min_groups``: fewer live groups than this and no step commits. ``timeout``: seconds a gradient
    average, a commit vote or a state transfer to a healing group may take; ``quorum_timeout``: seconds to
    wait for the groups to meet; ``connect_timeout``: seconds for the lighthouse to answer at start.
    ``hostname``: how the other groups reach this group's manager (default: this machine's name).
    ``max_uncommitted``: more steps than this in a row that do not commit (each drops its batch) end the job.
    """

    group: int
    groups: int
    lighthouse: Optional[str] = None
    min_groups: int = 1
    timeout: float = 60.0
    quorum_timeout: float = 60.0
    connect_timeout: float = 10.0
    hostname: Optional[str] = None
    max_uncommitted: int = 10

    def __post_init__(self) -> None:
        if not (isinstance(self.groups, int) and self.groups >= 1):
            raise PipelineConfigError(f"fault_tolerance groups={self.groups!r}: give the number of replica groups.")
        if not (isinstance(self.group, int) and 0 <= self.group < self.groups):
            raise PipelineConfigError(
                f"fault_tolerance group={self.group!r} with groups={self.groups}: each replica group needs its own"
                f" id from 0 to {self.groups - 1} (it picks the group's share of the data)."
            )
        if not 1 <= self.min_groups <= self.groups:
            raise PipelineConfigError(
                f"fault_tolerance min_groups={self.min_groups} with groups={self.groups}: a step commits with at"
                f" least min_groups live groups; give 1 to {self.groups}."
            )
        for name in ("timeout", "quorum_timeout", "connect_timeout"):
            if not getattr(self, name) > 0:
                raise PipelineConfigError(f"fault_tolerance {name}={getattr(self, name)!r}: give seconds > 0.")
        if self.lighthouse is not None:
            where = urlparse(self.lighthouse)
            if where.scheme not in ("http", "https") or not where.hostname or not where.port:
                raise PipelineConfigError(
                    f"fault_tolerance lighthouse={self.lighthouse!r}: give the address the lighthouse serves, such"
                    " as 'http://node0:29510' (torchft_lighthouse --bind [::]:29510)."
                )


def as_fault_tolerance(value: Union[FaultTolerance, Mapping[str, Any], None]) -> Optional[FaultTolerance]:
    """A dict (Hydra, LightningCLI) as the dataclass; unknown keys named."""
    if value is None or isinstance(value, FaultTolerance):
        return value
    known = {f.name for f in fields(FaultTolerance)}
    unknown = sorted(set(value) - known)
    if unknown or not isinstance(value, Mapping):
        raise PipelineConfigError(
            f"fault_tolerance={value!r}: {unknown} are not its keys; give a dict of {sorted(known)} (group and"
            " groups at least) or a lightning_pp.FaultTolerance."
        )
    integers = ("group", "groups", "min_groups", "max_uncommitted")
    return FaultTolerance(**{k: (int(v) if k in integers else v) for k, v in value.items()})


def refusals(
    fault_tolerance: Optional[FaultTolerance], schedule: str, auto: frozenset[str], weighted: bool
) -> Optional[str]:
    """Why these arguments cannot be exact with replica groups (None: they can)."""
    if fault_tolerance is None:
        return None
    if schedule == "2bw":
        return (
            "schedule='2bw' with fault_tolerance: a healing group would need the older weight version each stage"
            " stashes, which torchft's transfer does not carry. Use a flushing schedule (1f1b, gpipe,"
            " interleaved_1f1b, the zero-bubble ones)"
        )
    if auto:
        return (
            f"{sorted(auto)} given as 'auto' with fault_tolerance: each group would measure and choose on its own,"
            " and groups that chose differently average gradients of different layouts. Choose once (python -m"
            " lightning_pp.plan) and give every group the same explicit schedule, micro-batches and balance"
        )
    if weighted:
        return (
            "microbatch_weight with fault_tolerance: torchft averages each group's gradient with equal weight,"
            " which is the weighted mean only when every group's batches weigh the same. Leave microbatch_weight"
            " out, or train without fault_tolerance"
        )
    return None


def sampler_shard(fault_tolerance: Optional[FaultTolerance], dp: int, replica: int) -> dict[str, int]:
    """The sampler's replicas and this rank's index among them: each group reads its own share of the data
    (its id x its replicas + the replica; torchft's convention), every stage of a replica the same batches."""
    groups, group = (1, 0) if fault_tolerance is None else (fault_tolerance.groups, fault_tolerance.group)
    return {"num_replicas": groups * dp, "rank": group * dp + replica}
