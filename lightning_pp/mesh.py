"""Process groups of a pipeline x data-parallel job.

Ranks are laid out as a (dp, pp) grid with the pipeline axis innermost: global rank
``r = replica * pp + stage``. Consecutive ranks, and so the ranks of one node when ``pp`` divides
the devices per node, form one pipeline replica: its P2P traffic stays inside a node and only the
gradient all-reduce between replicas of the same stage crosses nodes.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import torch
import torch.distributed as dist
from torch.utils._pytree import tree_flatten

from lightning_pp.errors import PipelineConfigError
from lightning_pp.schedule import rank_of_stage, stages_of_rank


@dataclass(frozen=True)
class Layout:
    """Where one rank sits; pure arithmetic, the same on every rank."""

    world_size: int
    pp: int
    rank: int
    schedule: str = "1f1b"
    stages_per_rank: int = 1

    @property
    def dp(self) -> int:
        return self.world_size // self.pp

    @property
    def pp_rank(self) -> int:
        """This rank's position in its pipeline replica."""
        return self.rank % self.pp

    @property
    def n_stages(self) -> int:
        return self.pp * self.stages_per_rank

    @property
    def stages(self) -> list[int]:
        """The stages this rank holds, in stage order."""
        return sorted(stages_of_rank(self.schedule, self.pp_rank, self.pp, self.stages_per_rank))

    @property
    def replica(self) -> int:
        return self.rank // self.pp

    @property
    def last_stage_rank(self) -> int:
        """Global rank of the last stage of this rank's replica (where its loss and logs are)."""
        return self.stage_rank(self.n_stages - 1)

    def stage_rank(self, stage: int, replica: int | None = None) -> int:
        """Global rank holding ``stage`` in ``replica`` (default: this rank's)."""
        return (self.replica if replica is None else replica) * self.pp + rank_of_stage(self.schedule, stage, self.pp)

    @property
    def first_stage_rank(self) -> int:
        return self.replica * self.pp

    def pipeline_ranks(self, replica: int) -> list[int]:
        return [replica * self.pp + s for s in range(self.pp)]

    def replica_ranks(self, stage: int) -> list[int]:
        return [d * self.pp + stage for d in range(self.dp)]

    def describe(self, devices_per_node: int) -> str:
        lines = [f"Rank layout ({self.dp} pipeline replica(s) x {self.pp} stages; global rank = replica x pp + stage):"]
        for d in range(self.dp):
            cells = [f"rank {r} (node {r // devices_per_node})" for r in self.pipeline_ranks(d)]
            lines.append(f"  replica {d}: " + " -> ".join(cells))
        return "\n".join(lines)


def make_layout(
    pipeline_parallel_size: int | None, world_size: int, rank: int, schedule: str = "1f1b", stages_per_rank: int = 1
) -> Layout:
    pp = pipeline_parallel_size or world_size
    if pp < 1 or world_size % pp:
        raise PipelineConfigError(
            f"pipeline_parallel_size={pipeline_parallel_size} does not divide the world size {world_size}"
            f" (devices x nodes); choose a stage count that divides {world_size}, e.g."
            f" {[d for d in range(1, world_size + 1) if world_size % d == 0]}."
        )
    return Layout(world_size, pp, rank, schedule, stages_per_rank)


@dataclass(frozen=True)
class Groups:
    pp: dist.ProcessGroup | None  # this rank's pipeline replica (None: the whole world)
    dp: dist.ProcessGroup | None  # this stage across replicas (None: no replicas)


def make_groups(layout: Layout, device_type: str) -> Groups:
    """This rank's groups from a ("dp", "pp") DeviceMesh (collective: every rank calls it)."""
    if layout.dp == 1:
        return Groups(pp=None, dp=None)
    from torch.distributed.device_mesh import init_device_mesh

    mesh = init_device_mesh(device_type, (layout.dp, layout.pp), mesh_dim_names=("dp", "pp"))
    return Groups(pp=mesh.get_group("pp"), dp=mesh.get_group("dp"))


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
