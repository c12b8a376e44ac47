"""Choose a pipeline configuration by simulating every valid one with measured costs.

Pure functions: the costs come in (``profiling.measure_segments`` at two or more micro-batch sizes, the
machine's numbers from ``calibrate``, or numbers typed in for hardware this machine does not have), every
configuration for the devices is enumerated, ``simulate`` replays torch's own action lists for each, and
the predictions come back ranked. Formulas alone rank badly on real machines: the split backward costs more
than one backward, messages and per-action costs grow with the micro-batch count, stages are uneven.
"""

from __future__ import annotations

import itertools
from collections.abc import Iterable, Iterator, Sequence
from dataclasses import dataclass, field, replace

from lightning_pp.choose.machine import Machine
from lightning_pp.choose.simulate import Costs, Simulation, activation_peak, rank_actions, simulate
from lightning_pp.errors import PipelineConfigError
from lightning_pp.layout.schedule import (
    SCHEDULES,
    SINGLE_STAGE,
    V_SHAPED,
    check_microbatches,
    normalize_schedule,
    rank_of_stage,
    stages_of_rank,
)
from lightning_pp.split.partition import min_max_split, uniform_split
from lightning_pp.split.profiling import Segments

_MIB = 1 << 20


@dataclass(frozen=True)
class ModelCosts:
    """A model's measured costs at two or more micro-batch sizes (each value affine in the size), and what its
    optimizer costs: state bytes per parameter byte, seconds per parameter byte of one step."""

    measured: tuple[Segments, ...]
    optimizer_state_ratio: float = 2.0
    optimizer_s_per_byte: float = 0.0

    @property
    def n_layers(self) -> int:
        return len(self.measured[0].forward) - 2

    def at(self, size: int) -> Segments:
        """The costs of a micro-batch of ``size`` samples: the least-squares line through the measured sizes
        (exactly proportional when only one size was measured)."""
        points = sorted(self.measured, key=lambda s: s.size)
        if len(points) == 1:
            (only,) = points
            scale = size / only.size
            return replace(only, size=size, **{k: tuple(v * scale for v in getattr(only, k)) for k in _AFFINE})
        sizes = [p.size for p in points]
        mean = sum(sizes) / len(sizes)
        spread = sum((x - mean) ** 2 for x in sizes)

        def line(values: Sequence[float]) -> float:
            average = sum(values) / len(values)
            slope = sum((x - mean) * (y - average) for x, y in zip(sizes, values)) / spread
            return max(average + slope * (size - mean), 0.0)

        fitted = {k: tuple(line(column) for column in zip(*(getattr(p, k) for p in points))) for k in _AFFINE}
        return replace(points[0], size=size, **fitted)


_AFFINE = ("forward", "backward", "input_grad", "weight_grad", "saved_bytes", "boundary_bytes", "backward_bytes")


@dataclass(frozen=True)
class Config:
    """One way to run the model: what ``PipelineStrategy`` is given."""

    pipeline_parallel_size: int
    schedule: str
    stages_per_rank: int
    n_microbatches: int
    balance: tuple[int, ...]
    balance_mode: str  # "uniform", "profile" (the layer counts that even out the predicted stage costs) or "memory"
    # (layers moved off the ranks that peak highest, to fit a memory limit)
    activation_checkpointing: bool
    data_parallel: str = "ddp"  # with replicas, "fsdp" shards the optimizer state over them

    def overrides(self) -> str:
        """The Hydra overrides that make ``python -m lightning_pp.train`` run exactly this configuration."""
        balance = "uniform" if self.balance_mode == "uniform" else "[" + ",".join(map(str, self.balance)) + "]"
        return " ".join(
            [
                f"strategy.schedule={self.schedule}",
                f"strategy.pipeline_parallel_size={self.pipeline_parallel_size}",
                f"strategy.stages_per_rank={self.stages_per_rank}",
                f"strategy.n_microbatches={self.n_microbatches}",
                f"strategy.balance={balance}",
                f"strategy.activation_checkpointing={str(self.activation_checkpointing).lower()}",
                f"strategy.data_parallel={self.data_parallel}",
            ]
        )


@dataclass(frozen=True)
class Prediction:
    config: Config
    step_s: float
    samples_per_s: float
    peak_bytes: tuple[int, ...]  # per pipeline rank: parameters, gradients, optimizer state, activations, base
    activation_bytes: tuple[int, ...]  # per pipeline rank: the peak of activations saved for backward
    bubble: tuple[float, ...]
    simulation: Simulation | None = field(default=None, repr=False, compare=False)

    @property
    def peak_mib(self) -> float:
        return max(self.peak_bytes) / _MIB


def configurations(
    n_layers: int,
    devices: int,
    batch_size: int,
    schedules: Iterable[str] = SCHEDULES,
    pipeline_sizes: Iterable[int] | None = None,
    stages_per_rank: Iterable[int] = (2, 4),
    microbatches: Iterable[int] | None = None,
    activation_checkpointing: Iterable[bool] = (False, True),
    data_parallel: Iterable[str] = ("ddp", "fsdp"),
) -> Iterator[Config]:
    """Every configuration torch accepts on ``devices`` (pipeline ranks x replicas) for a model of ``n_layers``
    layers and a per-replica batch of ``batch_size``; balances are filled in by ``plan`` (they need costs)."""
    sizes = [p for p in range(2, devices + 1) if devices % p == 0] if pipeline_sizes is None else list(pipeline_sizes)
    counts = [m for m in range(1, batch_size + 1) if batch_size % m == 0] if microbatches is None else microbatches
    grid = itertools.product(sizes, map(normalize_schedule, schedules), counts, activation_checkpointing, data_parallel)
    for pp, name, m, ckpt, sharding in grid:
        if devices % pp:
            raise PipelineConfigError(f"pipeline_parallel_size={pp} does not divide the {devices} devices.")
        if sharding == "fsdp" and devices == pp:
            continue  # no replicas to shard over
        per_rank = [1] if name in SINGLE_STAGE else [2] if name in V_SHAPED else list(stages_per_rank)
        for v in per_rank:
            if pp * v > n_layers or batch_size % m:
                continue
            try:
                check_microbatches(name, m, pp, pp * v)
            except PipelineConfigError:
                continue
            yield Config(pp, name, v, m, tuple(uniform_split(n_layers, pp * v)), "uniform", ckpt, sharding)


def predict(config: Config, costs: ModelCosts, machine: Machine, batch_size: int, devices: int) -> Prediction:
    """Step time, throughput, per-rank peak memory and bubble of ``config`` with a per-replica batch of
    ``batch_size`` samples on ``devices`` devices."""
    pp, v, m = config.pipeline_parallel_size, config.stages_per_rank, config.n_microbatches
    segments = costs.at(batch_size // m)
    stages = _stage_segments(config.balance, costs.n_layers)
    layers = set(range(1, costs.n_layers + 1))
    recomputed = layers if config.activation_checkpointing else set()
    # a forward or backward receives from, and sends to, each neighbour stage on another rank: its own time too
    rank = [rank_of_stage(config.schedule, s, pp) for s in range(len(stages))]
    crossings = [sum(0 <= t < len(rank) and rank[t] != rank[s] for t in (s - 1, s + 1)) for s in range(len(rank))]

    def per_stage(column: Sequence[float], plus_recompute: bool = False, messages: bool = True) -> tuple[float, ...]:
        return tuple(
            machine.action_overhead_s
            + (machine.message_overhead_s * crossings[s] if messages else 0.0)
            + sum(column[k] for k in ks)
            + (sum(segments.forward[k] for k in ks if k in recomputed) if plus_recompute else 0.0)
            for s, ks in enumerate(stages)
        )

    cuts = [segments.boundary_bytes[ks[-1]] for ks in stages[:-1]]
    sim = simulate(
        config.schedule,
        pp,
        m,
        Costs(
            per_stage(segments.forward),
            per_stage(segments.backward, plus_recompute=True),
            per_stage(segments.input_grad, plus_recompute=True),
            per_stage(segments.weight_grad, messages=False),
            message=machine.message_s(max(cuts, default=0.0)),
        ),
        v,
        timeline=False,
    )
    peaks, saved, mine = _memory(config, costs, machine, batch_size, devices)
    dp = devices // pp
    # a ring all-reduce, or FSDP's all-gather and reduce-scatter: the same bytes on the wire
    finish = [
        costs.optimizer_s_per_byte * b
        + (0.0 if dp == 1 else 2 * (dp - 1) * (machine.latency_s + b / dp / machine.bandwidth_bytes_per_s))
        for b in mine
    ]
    step = sim.step_s + max(finish) + machine.step_overhead_s
    return Prediction(config, step, dp * batch_size / step, tuple(peaks), tuple(saved), tuple(sim.bubble), sim)


def _memory(
    config: Config, costs: ModelCosts, machine: Machine, batch_size: int, devices: int
) -> tuple[list[int], list[int], list[int]]:
    """Per pipeline rank: its peak bytes (parameters, gradients, optimizer state, activations, base, and what its
    costliest backward holds beyond them), the peak of its saved activations, and its parameter bytes."""
    pp, v, m = config.pipeline_parallel_size, config.stages_per_rank, config.n_microbatches
    segments = costs.at(batch_size // m)
    stages = _stage_segments(config.balance, costs.n_layers)
    recomputed = set(range(1, costs.n_layers + 1)) if config.activation_checkpointing else set()
    params = [sum(segments.param_bytes[k] for k in ks) for ks in stages]
    held = [
        sum(segments.boundary_bytes[k - 1] if k in recomputed else segments.saved_bytes[k] for k in ks) for ks in stages
    ]
    # recomputing a layer holds its whole activations again for the length of its backward
    transient = max((segments.saved_bytes[k] for k in recomputed), default=0)
    # a stage's costliest segment backward, on top of its saved activations (none where the costs were typed in)
    measured = segments.backward_bytes or (0,) * len(segments.saved_bytes)
    backward = [max((measured[k] for k in ks), default=0) for ks in stages]
    dp = devices // pp
    # FSDP2 keeps a stage unsharded for the step (fsdp_reshard="step"): what it shards is the optimizer state
    state = costs.optimizer_state_ratio / (dp if config.data_parallel == "fsdp" else 1)
    actions = rank_actions(config.schedule, pp, m, v)
    peaks, saved, mine = [], [], []
    for r in range(pp):
        held_stages = stages_of_rank(config.schedule, r, pp, v)
        mine.append(sum(params[s] for s in held_stages))
        saved.append(int(activation_peak(actions[r], held) + transient))
        most = max(backward[s] for s in held_stages)
        peaks.append(int(machine.base_bytes + mine[-1] * (2 + state) + saved[-1] + most))
    return peaks, saved, mine


def plan(
    costs: ModelCosts,
    machine: Machine,
    devices: int,
    batch_size: int,
    memory_limit_mib: float | None = None,
    **choices: object,
) -> list[Prediction]:
    """Every configuration (``configurations``' keyword ``choices`` narrow it), each with a uniform balance and,
    where different, the balance that evens out the predicted stage costs; best throughput first, those over
    ``memory_limit_mib`` on any rank dropped."""
    predictions, seen = [], set()
    for config in configurations(costs.n_layers, devices, batch_size, **choices):  # type: ignore[arg-type]
        balanced = _balanced(config, costs.at(batch_size // config.n_microbatches))
        for candidate in [config] + ([balanced] if balanced.balance != config.balance else []):
            if memory_limit_mib is not None:
                candidate = _under(memory_limit_mib, candidate, costs, machine, batch_size, devices)
            if candidate is not None and candidate not in seen:
                seen.add(candidate)
                predictions.append(predict(candidate, costs, machine, batch_size, devices))
    return sorted(predictions, key=lambda p: (-p.samples_per_s, p.peak_mib))


def _under(
    limit_mib: float, config: Config, costs: ModelCosts, machine: Machine, batch_size: int, devices: int
) -> Config | None:
    """``config``, or its layers moved one at a time off the rank predicted to peak highest (under 1F1B the first
    ranks hold the most micro-batches in flight) onto a neighbouring stage until every rank's peak fits
    ``limit_mib``; None where no such move is left. Memory only: no schedule is simulated on the way."""
    pp = config.pipeline_parallel_size
    for _ in range(costs.n_layers):
        peaks = _memory(config, costs, machine, batch_size, devices)[0]
        if max(peaks) <= limit_mib * _MIB:
            return config
        top = max(range(pp), key=lambda r: peaks[r])
        counts = list(config.balance)
        mine = [s for s in stages_of_rank(config.schedule, top, pp, config.stages_per_rank) if counts[s] > 1]
        if not mine:
            return None
        stage = max(mine, key=lambda s: counts[s])
        # to the neighbour whose rank peaks lower
        target = min(
            (t for t in (stage - 1, stage + 1) if 0 <= t < len(counts)),
            key=lambda t: peaks[rank_of_stage(config.schedule, t, pp)],
        )
        if rank_of_stage(config.schedule, target, pp) == top:
            return None
        counts[stage], counts[target] = counts[stage] - 1, counts[target] + 1
        config = replace(config, balance=tuple(counts), balance_mode="memory")
    return config if max(_memory(config, costs, machine, batch_size, devices)[0]) <= limit_mib * _MIB else None


def _balanced(config: Config, segments: Segments) -> Config:
    """The layer counts whose stages cost most evenly (forward and backward, recomputation included)."""
    total = [f + b for f, b in zip(segments.forward, segments.backward)]
    if config.activation_checkpointing:
        total = [t + (f if 0 < k < len(total) - 1 else 0.0) for k, (t, f) in enumerate(zip(total, segments.forward))]
    counts = min_max_split(total[1:-1], config.pipeline_parallel_size * config.stages_per_rank, total[0], total[-1])
    return replace(config, balance=tuple(counts), balance_mode="profile")


def _stage_segments(counts: Sequence[int], n_layers: int) -> list[list[int]]:
    """Each stage's segments: 0 is before the layers, 1..n the layers, n + 1 after them."""
    out, start = [], 1
    for c in counts:
        out.append(list(range(start, start + c)))
        start += c
    out[0].insert(0, 0)
    out[-1].append(n_layers + 1)
    return out
