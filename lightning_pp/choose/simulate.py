"""A timing model of torch's schedules: the per-rank action lists torch itself executes, replayed with costs.

torch 2.13 builds every schedule's per-rank list in one process but has no timing simulator (its
``_simulate_comms_compute`` is a unit-step deadlock check). Each rank here runs its list in order; an
action starts when its rank is free and its input exists: a forward needs the previous stage's forward
of that micro-batch, a backward (full, or its input half I) the next stage's, the weight half W its own
I, plus one message time where the two stages sit on different ranks. GPipe's and 1F1B's lists are
built here as their runtime runs them (torch's informational 1F1B list mislabels the last rank's
micro-batches); the others come from torch's own builders, V placement and DualPipeV's overlapped
F;B pairs included (run back to back, as the runtime does without a custom overlap function).
"""

from __future__ import annotations

import functools
import statistics
from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import NamedTuple

from lightning_pp.layout.schedule import SCHEDULES, normalize_schedule, stages_of_rank
from lightning_pp.runtime.telemetry import Event, covered


class Action(NamedTuple):
    stage: int
    kind: str  # F, B (full backward), I (input gradients), W (weight gradients)
    microbatch: int


@dataclass(frozen=True)
class Costs:
    """Seconds per micro-batch for each stage, and per message between two ranks (latency + bytes / bandwidth).

    ``input_grad`` and ``weight_grad`` are the two halves the zero-bubble and V schedules run instead of
    ``backward`` (together they cost more than one full backward on CPU: two autograd passes)."""

    forward: tuple[float, ...]
    backward: tuple[float, ...]
    input_grad: tuple[float, ...] = ()
    weight_grad: tuple[float, ...] = ()
    message: float = 0.0

    def of(self, action: Action) -> float:
        table = {"F": self.forward, "B": self.backward, "I": self.input_grad, "W": self.weight_grad}[action.kind]
        return table[action.stage]


@dataclass
class Simulation:
    step_s: float
    busy_s: list[float]  # per pipeline rank
    timeline: list[Event] = field(repr=False)
    # per rank: micro-batches whose activations each of its stages holds when the rank holds the most in all
    in_flight: list[dict[int, int]] = field(repr=False)

    @property
    def bubble(self) -> list[float]:
        """Per rank: the share of the step it waits."""
        return [1 - busy / self.step_s for busy in self.busy_s]


@functools.lru_cache(maxsize=64)
def rank_actions(
    schedule: str, pp: int, n_microbatches: int, stages_per_rank: int = 1
) -> tuple[tuple[Action, ...], ...]:
    """Every pipeline rank's computations in the order its runtime runs them (kept: a plan asks again for every
    balance and recomputation of one schedule)."""
    name = normalize_schedule(schedule)
    m = n_microbatches
    if name == "gpipe":
        return tuple(
            tuple([Action(r, "F", i) for i in range(m)] + [Action(r, "B", i) for i in range(m)]) for r in range(pp)
        )
    if name == "1f1b":
        return tuple(tuple(_one_f_one_b(r, pp, m)) for r in range(pp))
    from torch.distributed.pipelining._schedule_visualizer import get_schedule_ops

    lists = get_schedule_ops(SCHEDULES[name], pp, m, stages_per_rank)
    return tuple(tuple(a for action in ops if action is not None for a in _computations(action)) for ops in lists)


def _one_f_one_b(rank: int, pp: int, m: int) -> list[Action]:
    """torch's ``Schedule1F1B._step_microbatches``: min(m, pp - rank) warm-up forwards, then B and F in turn."""
    warmup = min(m, pp - rank)
    actions = [Action(rank, "F", i) for i in range(warmup)]
    for i in range(m):
        actions.append(Action(rank, "B", i))
        if warmup + i < m:
            actions.append(Action(rank, "F", warmup + i))
    return actions


def _computations(action: object) -> list[Action]:
    sub = getattr(action, "sub_actions", None)
    if sub:  # OVERLAP_F_B: its halves back to back
        return [a for part in sub for a in _computations(part)]
    kind = {"FORWARD": "F", "FULL_BACKWARD": "B", "BACKWARD_INPUT": "I", "BACKWARD_WEIGHT": "W"}.get(
        action.computation_type.name  # type: ignore[attr-defined]
    )
    return [] if kind is None else [Action(action.stage_index, kind, action.microbatch_index)]  # type: ignore[attr-defined]


def simulate(
    schedule: str, pp: int, n_microbatches: int, costs: Costs, stages_per_rank: int = 1, timeline: bool = True
) -> Simulation:
    """One training step of ``schedule`` on ``pp`` ranks with ``costs``: its time, each rank's busy time, the
    timeline (``Event`` rows per rank, as the telemetry records them; ``timeline=False`` leaves it empty, twice as
    fast for a planner) and the micro-batches each stage holds."""
    name = normalize_schedule(schedule)
    lists = rank_actions(name, pp, n_microbatches, stages_per_rank)
    n_stages = pp * stages_per_rank
    rank_of = {s: r for r in range(pp) for s in stages_of_rank(name, r, pp, stages_per_rank)}
    last = n_stages - 1
    done: dict[Action, float] = {}
    clock = [0.0] * pp
    busy = [0.0] * pp
    position = [0] * pp
    events: list[Event] = []
    remaining = sum(len(actions) for actions in lists)
    while remaining:
        progressed = False
        for r in range(pp):
            while position[r] < len(lists[r]):
                action = lists[r][position[r]]
                ready = _input_ready(action, done, rank_of, last, costs.message)
                if ready is None:
                    break
                start = max(clock[r], ready)
                chunk = action.stage // pp
                if timeline and start > clock[r]:  # waiting for the input, as the telemetry records a receive
                    events.append(Event(r, "P", action.microbatch, clock[r], start, chunk))
                took = costs.of(action)
                busy[r] += took
                clock[r] = done[action] = start + took
                if timeline:
                    events.append(Event(r, action.kind, action.microbatch, start, clock[r], chunk))
                position[r] += 1
                remaining -= 1
                progressed = True
        if not progressed:
            stuck = {r: lists[r][position[r]] for r in range(pp) if position[r] < len(lists[r])}
            raise RuntimeError(f"{schedule} on {pp} ranks, m={n_microbatches}: no rank can go on: {stuck}")
    return Simulation(max(clock), busy, events, [_held(actions)[1] for actions in lists])


def _input_ready(
    action: Action, done: dict[Action, float], rank_of: dict[int, int], last: int, message: float
) -> float | None:
    """When ``action``'s input exists on its rank; None while the action that makes it has not run."""
    s, mb = action.stage, action.microbatch
    if action.kind == "F":
        if s == 0:
            return 0.0
        makers: tuple[Action, ...] = (Action(s - 1, "F", mb),)
    elif action.kind == "W":
        makers = (Action(s, "I", mb),)
    elif s == last:
        makers = (Action(s, "F", mb),)
    else:
        makers = (Action(s + 1, "B", mb), Action(s + 1, "I", mb))
    maker = next((a for a in makers if a in done), None)
    if maker is None:
        return None
    return done[maker] + (message if rank_of[maker.stage] != rank_of[s] else 0.0)


def activation_peak(actions: Sequence[Action], stage_bytes: Sequence[float]) -> float:
    """The most activation bytes a rank holds at once running ``actions`` in order: each micro-batch holds
    ``stage_bytes[stage]`` from its forward until its backward (full, or the weight half that ends it)."""
    return _held(actions, stage_bytes)[0]


def _held(actions: Sequence[Action], weight: Sequence[float] | None = None) -> tuple[float, dict[int, int]]:
    """The peak of what the rank holds (micro-batches, or their bytes with ``weight`` per stage) and, per stage,
    the micro-batches held (from F until B, or until W) at that moment."""
    held: dict[int, int] = {}
    peak: tuple[float, dict[int, int]] = (0.0, {})
    for a in actions:
        if a.kind == "F":
            held[a.stage] = held.get(a.stage, 0) + 1
        elif a.kind in "BW":
            held[a.stage] -= 1
        total = sum(n * (1.0 if weight is None else weight[s]) for s, n in held.items())
        if total > peak[0]:
            peak = (total, dict(held))
    return peak


def replay(
    events: Sequence[Event], schedule: str, pp: int, n_microbatches: int, stages_per_rank: int = 1, message: float = 0.0
) -> Simulation:
    """The simulator run with what a recorded step's actions took (``PipelineMonitor``'s events: the medians per
    stage and kind, the user's loss with the last stage's forward, and each rank's time neither computing nor
    waiting spread over its actions as their overhead): how much of a measured step the model explains."""
    n_stages = pp * stages_per_rank
    durations: dict[tuple[int, str], list[float]] = {}
    glue = []
    for r in range(pp):
        mine = [e for e in events if e.stage == r]
        computed = [e for e in mine if e.kind in "FBIWL"]
        span = max(e.end for e in computed) - min(e.start for e in computed)
        waited = covered(
            [(e.start, e.end) for e in mine if e.kind == "P"],
            min(e.start for e in computed),
            max(e.end for e in computed),
        )
        glue.append((span - sum(e.seconds for e in computed) - waited) / len(computed))
        for e in computed:
            stage = n_stages - 1 if e.kind == "L" else stages_of_rank(schedule, r, pp, stages_per_rank)[e.chunk]
            durations.setdefault((stage, e.kind), []).append(e.seconds)
    overhead = max(statistics.median(glue), 0.0)

    def column(kind: str) -> tuple[float, ...]:
        return tuple(statistics.median(durations.get((s, kind), [0.0])) + overhead for s in range(n_stages))

    forward = list(column("F"))
    forward[-1] += column("L")[-1]
    return simulate(
        schedule,
        pp,
        n_microbatches,
        Costs(tuple(forward), column("B"), column("I"), column("W"), message),
        stages_per_rank,
    )
