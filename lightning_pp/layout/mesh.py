"""Process groups of a data x pipeline x tensor parallel job.

Ranks are laid out as a (dp, pp, tp) grid with the tensor-parallel axis innermost and the pipeline
axis next: global rank ``r = (replica * pp + stage) * tp + shard``. The ranks of one tensor-parallel
group are consecutive (one node: their collectives run in every layer), one pipeline replica comes
next (its P2P traffic stays inside a node when ``pp x tp`` divides the devices per node), and only
the gradient reduction between replicas of the same stage crosses nodes. Each (replica, shard) pair
runs its own pipeline: the same batch, the same stages, its own slice of each tensor-parallel layer.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import torch
import torch.distributed as dist
from torch.utils._pytree import tree_flatten

from lightning_pp.errors import PipelineConfigError
from lightning_pp.layout.options import PipelineOptions
from lightning_pp.layout.schedule import rank_of_stage, stages_of_rank


@dataclass(frozen=True)
class Layout:
    """Where one rank sits; pure arithmetic, the same on every rank."""

    world_size: int
    pp: int
    rank: int
    schedule: str = "1f1b"
    stages_per_rank: int = 1
    tp: int = 1

    @property
    def dp(self) -> int:
        return self.world_size // (self.pp * self.tp)

    @property
    def tp_rank(self) -> int:
        """This rank's shard of its tensor-parallel layers."""
        return self.rank % self.tp

    @property
    def pp_rank(self) -> int:
        """This rank's position in its pipeline replica."""
        return self.rank // self.tp % self.pp

    @property
    def n_stages(self) -> int:
        return self.pp * self.stages_per_rank

    @property
    def stages(self) -> list[int]:
        """The stages this rank holds, in stage order."""
        return sorted(stages_of_rank(self.schedule, self.pp_rank, self.pp, self.stages_per_rank))

    @property
    def replica(self) -> int:
        return self.rank // (self.pp * self.tp)

    @property
    def writes_full_checkpoint(self) -> bool:
        """Replicas and tensor-parallel shards hold the same (gathered) values: one pipeline makes the file."""
        return self.replica == 0 and self.tp_rank == 0

    @property
    def last_stage_rank(self) -> int:
        """Global rank of the last stage of this rank's replica (where its loss and logs are)."""
        return self.stage_rank(self.n_stages - 1)

    def stage_rank(self, stage: int, replica: int | None = None, tp_rank: int | None = None) -> int:
        """Global rank holding ``stage`` in ``replica`` and tensor-parallel shard ``tp_rank`` (default: this rank's)."""
        replica = self.replica if replica is None else replica
        return self._rank_at(replica, rank_of_stage(self.schedule, stage, self.pp), tp_rank)

    def _rank_at(self, replica: int, pp_rank: int, tp_rank: int | None = None) -> int:
        return (replica * self.pp + pp_rank) * self.tp + (self.tp_rank if tp_rank is None else tp_rank)

    @property
    def first_stage_rank(self) -> int:
        return self._rank_at(self.replica, 0)

    def pipeline_ranks(self, replica: int, tp_rank: int | None = None) -> list[int]:
        return [self._rank_at(replica, s, tp_rank) for s in range(self.pp)]

    def replica_ranks(self, pp_rank: int) -> list[int]:
        return [self._rank_at(d, pp_rank) for d in range(self.dp)]

    def describe(self, devices_per_node: int) -> str:
        shards = f" x {self.tp} tensor-parallel shards" if self.tp > 1 else ""
        formula = "(replica x pp + stage) x tp + shard" if self.tp > 1 else "replica x pp + stage"
        lines = [f"Rank layout ({self.dp} pipeline replica(s) x {self.pp} stages{shards}; global rank = {formula}):"]
        for d in range(self.dp):
            for t in range(self.tp):
                cells = [f"rank {r} (node {r // devices_per_node})" for r in self.pipeline_ranks(d, t)]
                shard = f", shard {t}" if self.tp > 1 else ""
                lines.append(f"  replica {d}{shard}: " + " -> ".join(cells))
        return "\n".join(lines)


def make_layout(
    pipeline_parallel_size: int | None,
    world_size: int,
    rank: int,
    schedule: str = "1f1b",
    stages_per_rank: int = 1,
    tensor_parallel_size: int = 1,
    expert_parallel_size: int = 1,
) -> Layout:
    tp = int(tensor_parallel_size)
    if tp < 1 or world_size % tp:
        raise PipelineConfigError(
            f"tensor_parallel_size={tensor_parallel_size} does not divide the world size {world_size} (devices x"
            f" nodes); choose one of {[d for d in range(1, world_size + 1) if world_size % d == 0]}, usually the"
            " devices of one node or fewer."
        )
    pp = pipeline_parallel_size or world_size // tp
    if pp < 1 or world_size % (pp * tp):
        raise PipelineConfigError(
            f"pipeline_parallel_size={pipeline_parallel_size}{f' x tensor_parallel_size={tp}' if tp > 1 else ''} does"
            f" not divide the world size {world_size} (devices x nodes); choose a stage count that divides"
            f" {world_size // tp}, e.g."
            f" {[d for d in range(1, world_size // tp + 1) if (world_size // tp) % d == 0]}."
        )
    dp = world_size // (pp * tp)
    if expert_parallel_size not in (1, dp):
        raise PipelineConfigError(
            f"expert_parallel_size={expert_parallel_size} with {dp} pipeline replica(s) ({world_size} ranks /"
            f" {pp} stages{f' / {tp} shards' if tp > 1 else ''}): each stage's experts are split over all of its"
            f" replicas. Use expert_parallel_size={dp} (or 1), or choose pipeline_parallel_size so that"
            f" {expert_parallel_size} replicas remain."
        )
    return Layout(world_size, pp, rank, schedule, stages_per_rank, tp)


def layout_of(o: PipelineOptions, world_size: int, rank: int) -> Layout:
    """The layout the strategy's arguments give ``rank``."""
    return make_layout(o.pipeline_parallel_size, world_size, rank, o.schedule, o.stages_per_rank,
                       o.tensor_parallel_size, o.expert_parallel_size)  # fmt: skip


MESH_DIMS = ("data_parallel", "pipeline_parallel", "tensor_parallel")


@dataclass(frozen=True)
class Groups:
    pp: dist.ProcessGroup | None  # this rank's pipeline (None: the whole world)
    dp: dist.ProcessGroup | None  # this stage and shard across replicas (None: no replicas)
    mesh: Any = None  # the (data, pipeline, tensor) DeviceMesh over the world, named by MESH_DIMS
    host_pp: dist.ProcessGroup | None = None  # this rank's pipeline over gloo, where ``pp`` is NCCL


def make_groups(layout: Layout, device_type: str) -> Groups:
    """This rank's groups from the world's DeviceMesh (collective: every rank calls it)."""
    from torch.distributed.device_mesh import init_device_mesh

    mesh = init_device_mesh(device_type, (layout.dp, layout.pp, layout.tp), mesh_dim_names=MESH_DIMS)
    host = _host_pipelines(layout) if device_type == "cuda" else None
    if layout.dp == 1 and layout.tp == 1:
        return Groups(pp=None, dp=None, mesh=mesh, host_pp=host)
    dp = mesh.get_group("data_parallel") if layout.dp > 1 else None
    return Groups(pp=mesh.get_group("pipeline_parallel"), dp=dp, mesh=mesh, host_pp=host)


def _host_pipelines(layout: Layout) -> dist.ProcessGroup:
    """This rank's pipeline over gloo, for what its ranks hand each other on the host (the report relay's lengths
    and names) without a device synchronisation; every rank makes every pipeline's, in one order."""
    mine = None
    for replica in range(layout.dp):
        for shard in range(layout.tp):
            ranks = layout.pipeline_ranks(replica, shard)
            group = dist.new_group(ranks, backend="gloo")
            if layout.rank in ranks:
                mine = group
    assert mine is not None
    return mine


def batch_fingerprint(batch: Any) -> torch.Tensor:
    """A number that differs, in practice, between different batches: a weighted sum of every tensor leaf."""
    total = torch.zeros((), dtype=torch.float64)
    for i, leaf in enumerate(tree_flatten(batch)[0]):
        if isinstance(leaf, torch.Tensor) and leaf.numel():
            flat = leaf.detach().reshape(-1).to("cpu", torch.float64)
            weights = torch.arange(1, flat.numel() + 1, dtype=torch.float64).remainder_(9973)
            total += (i + 1) * (flat * weights).sum() + flat.numel()
    return total


def check_same_batch(batch: Any, group: dist.ProcessGroup | None) -> None:
    """Every stage of one pipeline must run the same batch; a sampler that ignores the replica breaks that."""
    if not dist.is_initialized():
        return
    mine = batch_fingerprint(batch).reshape(1)
    device = "cuda" if dist.get_backend(group) == "nccl" else "cpu"
    seen = [torch.zeros(1, dtype=torch.float64, device=device) for _ in range(dist.get_world_size(group))]
    dist.all_gather(seen, mine.to(device), group=group)
    if any(not torch.equal(s.cpu(), seen[0].cpu()) for s in seen):
        raise PipelineConfigError(
            "The stages of one pipeline received different batches (their fingerprints differ:"
            f" {[float(s) for s in seen]}). Every stage of a pipeline replica must load the same batch: use"
            " Lightning's default sampler, or a sampler that shards by the replica index"
            " (trainer.strategy.distributed_sampler_kwargs), not by the global rank."
        )


def vote(decision: bool, all: bool, device: torch.device) -> bool:
    """Every rank's ``decision`` combined over the whole world: all of them, or any."""
    votes = torch.tensor(int(decision), device=device)
    dist.all_reduce(votes, op=dist.ReduceOp.SUM)
    return bool(votes == dist.get_world_size()) if all else bool(votes)
