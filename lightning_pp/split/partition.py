"""Which consecutive layers each pipeline stage owns.

Pure functions over layer counts and costs, so the split can be tested without processes.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import NamedTuple

from lightning_pp.errors import PipelineConfigError
from lightning_pp.layout.options import Balance, check_balance_mode


class Costs(NamedTuple):
    """Cost of each layer and of the parts before (embedding) and after (norm, head, loss) the layers."""

    layers: list[float]
    first: float = 0.0
    last: float = 0.0

    def of_stages(self, counts: Sequence[int]) -> list[float]:
        """What each stage of the split ``counts`` costs."""
        loads, start = [], 0
        for c in counts:
            loads.append(sum(self.layers[start : start + c]))
            start += c
        loads[0] += self.first
        loads[-1] += self.last
        return loads


def uniform_split(n_layers: int, n_stages: int) -> list[int]:
    """Layer counts per stage that differ by at most one, the larger counts first."""
    base, extra = divmod(n_layers, n_stages)
    return [base + (1 if s < extra else 0) for s in range(n_stages)]


def min_max_split(
    costs: Sequence[float], n_stages: int, first_extra: float = 0.0, last_extra: float = 0.0
) -> list[int]:
    """The split into consecutive non-empty runs that minimises the most expensive stage.

    ``first_extra`` and ``last_extra`` are the costs of the parts that sit before and after the
    layers (embedding; norm and head): they always land on the first and last stage, so a heavy
    head pulls layers away from the last stage. Exact dynamic programme, O(n^2 p); ties go to
    the split with earlier stages holding more layers, matching ``uniform_split``.
    """
    n = len(costs)
    _check_counts(n, n_stages)
    prefix = [0.0]
    for c in costs:
        prefix.append(prefix[-1] + float(c))

    def stage_cost(s: int, i: int, j: int) -> float:
        cost = prefix[j] - prefix[i]
        if s == 0:
            cost += first_extra
        if s == n_stages - 1:
            cost += last_extra
        return cost

    inf = float("inf")
    # best[s][j]: minimal max cost placing the first j layers on stages 0..s.
    best = [[inf] * (n + 1) for _ in range(n_stages)]
    cut = [[0] * (n + 1) for _ in range(n_stages)]
    for j in range(1, n + 1):
        best[0][j] = stage_cost(0, 0, j)
    for s in range(1, n_stages):
        for j in range(s + 1, n + 1):
            # iterate i downwards so that on ties the previous stages keep more layers
            for i in range(j - 1, s - 1, -1):
                value = max(best[s - 1][i], stage_cost(s, i, j))
                if value < best[s][j]:
                    best[s][j], cut[s][j] = value, i
    counts: list[int] = []
    j = n
    for s in range(n_stages - 1, 0, -1):
        i = cut[s][j]
        counts.append(j - i)
        j = i
    counts.append(j)
    return counts[::-1]


def resolve_balance(balance: Balance, n_layers: int, n_stages: int, costs: Costs | None = None) -> list[int]:
    """Turn the user's ``balance`` into layer counts per stage, or say exactly what is wrong.

    ``costs`` are what the cost-based modes ("parameters", "profile") balance; the caller measures them.
    """
    _check_counts(n_layers, n_stages)
    if balance is None or (isinstance(balance, str) and balance.lower() == "uniform"):
        return uniform_split(n_layers, n_stages)
    if isinstance(balance, str):
        check_balance_mode(balance)
        if costs is None or len(costs.layers) != n_layers:
            raise ValueError(f"balance={balance!r} needs the cost of each of the {n_layers} layers")
        return min_max_split(costs.layers, n_stages, costs.first, costs.last)
    counts = [int(c) for c in balance]
    if len(counts) != n_stages:
        raise PipelineConfigError(
            f"balance={list(balance)} has {len(counts)} entries but the pipeline has {n_stages} stages;"
            f" give one layer count per stage, e.g. {uniform_split(n_layers, n_stages)}."
        )
    if any(c < 1 for c in counts):
        raise PipelineConfigError(f"balance={list(balance)} gives a stage no layers; every stage needs at least one.")
    if sum(counts) != n_layers:
        raise PipelineConfigError(
            f"balance={list(balance)} sums to {sum(counts)} but the model has {n_layers} layers;"
            f" the counts must add up to {n_layers}, e.g. {uniform_split(n_layers, n_stages)}."
        )
    return counts


def stage_of_each_layer(counts: Sequence[int]) -> list[int]:
    """Stage index of every layer, in layer order."""
    return [s for s, c in enumerate(counts) for _ in range(c)]


def _check_counts(n_layers: int, n_stages: int) -> None:
    if n_stages < 1:
        raise PipelineConfigError(f"A pipeline needs at least one stage, got {n_stages}.")
    if n_layers < n_stages:
        raise PipelineConfigError(
            f"The model has {n_layers} layers but the pipeline has {n_stages} stages; every stage needs at"
            f" least one layer: use at most {n_layers} stages (pipeline ranks x stages_per_rank; the V schedules"
            " hold 2 per rank) or a model with more layers."
        )
