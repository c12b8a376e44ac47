import itertools

import pytest

from lightning_pp.split.partition import Costs, min_max_split, resolve_balance, stage_of_each_layer, uniform_split


def brute_force(costs, n_stages, first=0.0, last=0.0):
    n = len(costs)
    best = None
    for cuts in itertools.combinations(range(1, n), n_stages - 1):
        bounds = (0, *cuts, n)
        loads = [sum(costs[a:b]) for a, b in zip(bounds, bounds[1:])]
        loads[0] += first
        loads[-1] += last
        best = max(loads) if best is None else min(best, max(loads))
    return best


def test_uniform_split_puts_the_remainder_first():
    assert uniform_split(8, 2) == [4, 4]
    assert uniform_split(8, 3) == [3, 3, 2]
    assert uniform_split(5, 4) == [2, 1, 1, 1]


@pytest.mark.parametrize(
    "costs,n_stages,first,last",
    [
        ([1, 1, 1, 1, 1, 1, 1, 1], 2, 0, 0),
        ([1, 1, 1, 1, 1, 1, 1, 1], 2, 0, 5),  # a heavy vocab head pulls layers off the last stage
        ([5, 1, 1, 1, 1, 9, 2, 2, 3], 3, 2, 1),
        ([3, 8, 2, 7, 1, 1, 6, 4, 2, 9], 4, 0, 12),
        ([1, 2, 3, 4, 5, 6, 7], 7, 0, 0),
    ],
)
def test_min_max_split_is_optimal(costs, n_stages, first, last):
    counts = min_max_split(costs, n_stages, first, last)
    assert sum(counts) == len(costs) and len(counts) == n_stages and min(counts) >= 1
    assert max(Costs(costs, first, last).of_stages(counts)) == brute_force(costs, n_stages, first, last)


def test_heavy_head_moves_layers_to_earlier_stages():
    assert min_max_split([1] * 8, 2, 0, 4) == [6, 2]


def test_balance_list_and_modes():
    assert resolve_balance([3, 5], 8, 2) == [3, 5]
    assert resolve_balance("UNIFORM", 8, 2) == [4, 4]
    assert resolve_balance("parameters", 4, 2, Costs([1, 1, 1, 1], 0, 2)) == [3, 1]
    assert resolve_balance("Profile", 4, 2, Costs([1, 1, 1, 1], 3, 0)) == [1, 3]
    assert stage_of_each_layer([2, 1]) == [0, 0, 1]


@pytest.mark.parametrize(
    "balance,n_layers,n_stages,match",
    [
        ([3, 4], 8, 2, r"sums to 7 but the model has 8 layers"),
        ([8], 8, 2, r"has 1 entries but the pipeline has 2 stages"),
        ([8, 0], 8, 2, r"gives a stage no layers"),
        ("fastest", 8, 2, r"Unknown balance='fastest'"),
        (None, 2, 3, r"2 layers but the pipeline has 3 stages"),
    ],
)
def test_bad_balance_names_the_value_and_the_fix(balance, n_layers, n_stages, match):
    with pytest.raises(ValueError, match=match):
        resolve_balance(balance, n_layers, n_stages)
