"""The schedule simulator (lightning_pp.choose.simulate) against the closed forms, with uniform costs: one process."""

from __future__ import annotations

import pytest

from lightning_pp.choose.simulate import Costs, rank_actions, replay, simulate


def uniform(pp: int, v: int, forward: float = 1.0, backward: float = 2.0, weight: float = 1.0) -> Costs:
    """A stage of 1/v of a rank's layers: 1/v of its costs; the weight half of its backward ``weight``/v."""
    n = pp * v
    return Costs((forward / v,) * n, (backward / v,) * n, ((backward - weight) / v,) * n, (weight / v,) * n)


@pytest.mark.parametrize("schedule", ["gpipe", "1f1b"])
@pytest.mark.parametrize("pp, m", [(2, 4), (4, 8), (8, 8), (4, 13)])
def test_flushing_schedules_pay_the_bubble_bound(schedule, pp, m):
    sim = simulate(schedule, pp, m, uniform(pp, 1))
    assert sim.step_s == pytest.approx((m + pp - 1) * 3.0)
    assert sim.bubble == pytest.approx([(pp - 1) / (m + pp - 1)] * pp)


@pytest.mark.parametrize("schedule", ["interleaved_1f1b", "looped_bfs"])
@pytest.mark.parametrize("pp, m, v", [(2, 4, 2), (4, 8, 2), (4, 8, 4)])
def test_interleaved_schedules_divide_the_bubble_by_the_stages_per_rank(schedule, pp, m, v):
    sim = simulate(schedule, pp, m, uniform(pp, v), v)
    assert sim.bubble == pytest.approx([(pp - 1) / (v * m + pp - 1)] * pp)


@pytest.mark.parametrize("schedule", ["interleaved_zb", "zbv"])
@pytest.mark.parametrize("pp, m", [(2, 4), (4, 8)])
def test_zero_bubble_schedules_pay_what_the_weight_half_cannot_fill(schedule, pp, m):
    # per stage (a rank holds 2): F, B = I + W; the zero-bubble papers' bound (p-1)(F + B - 2W) beyond the work
    costs = uniform(pp, 2, forward=1.0, backward=2.0, weight=1.0)
    f, b, w = costs.forward[0], costs.backward[0], costs.weight_grad[0]
    work = m * 2 * (f + b)
    assert simulate(schedule, pp, m, costs, 2).step_s == pytest.approx(work + (pp - 1) * (f + b - 2 * w))
    # a free weight half leaves the whole backward in the bubble: no better than interleaving
    free = uniform(pp, 2, weight=0.0)
    assert simulate(schedule, pp, m, free, 2).step_s > simulate(schedule, pp, m, costs, 2).step_s


def test_messages_between_ranks_delay_the_critical_path():
    pp, m, hop = 4, 8, 0.25
    base = uniform(pp, 1)
    costs = Costs(base.forward, base.backward, message=hop)
    # GPipe's critical path crosses the pipeline twice: the last micro-batch's forward, the first's backward
    assert simulate("gpipe", pp, m, costs).step_s == pytest.approx((m + pp - 1) * 3.0 + 2 * (pp - 1) * hop)
    # 1F1B waits a round trip in its steady state too: more micro-batches, more messages on the critical path
    extra = [simulate("1f1b", pp, k, costs).step_s - (k + pp - 1) * 3.0 for k in (m, 2 * m)]
    assert 2 * (pp - 1) * hop < extra[0] < extra[1]


def test_micro_batches_in_flight_come_from_the_runtime_order():
    pp, m = 4, 8
    assert simulate("gpipe", pp, m, uniform(pp, 1)).in_flight == [{s: m} for s in range(pp)]
    assert simulate("1f1b", pp, m, uniform(pp, 1)).in_flight == [{s: min(m, pp - s)} for s in range(pp)]
    # two stages per rank, in micro-batches of one stage at the rank's peak: interleaved 1F1B holds p + (p-1)/v
    # rank-units on rank 0 (v = 2), looped BFS all m of both, the zero-bubble ones p on every rank, DualPipeV p + 1/2
    peaks = {"interleaved_1f1b": [2 * pp + pp - 1], "looped_bfs": [2 * m] * pp, "interleaved_zb": [2 * pp] * pp,
             "zbv": [2 * pp] * pp, "dualpipev": [2 * pp + 1] * pp}  # fmt: skip
    for schedule, expected in peaks.items():
        lists = rank_actions(schedule, pp, m, 2)
        forwards = sorted((a.stage, a.microbatch) for actions in lists for a in actions if a.kind == "F")
        assert forwards == [(s, i) for s in range(2 * pp) for i in range(m)], schedule  # each micro-batch once
        held = simulate(schedule, pp, m, uniform(pp, 2), 2).in_flight
        assert [sum(h.values()) for h in held][: len(expected)] == expected, (schedule, held)


def test_the_timeline_is_the_telemetry_s_events():
    sim = simulate("1f1b", 2, 4, uniform(2, 1))
    rows = {e.stage for e in sim.timeline}
    computed = [e for e in sim.timeline if e.kind != "P"]
    assert rows == {0, 1} and len(computed) == 2 * 2 * 4
    for r in rows:  # each rank runs one action or waits at a time, and waits only for what it lacks
        mine = sorted((e.start, e.end) for e in sim.timeline if e.stage == r)
        assert sum(b - a for a, b in mine) == pytest.approx(sim.step_s if r == 0 else mine[-1][1])
        assert all(a[1] <= b[0] + 1e-12 for a, b in zip(mine, mine[1:]))


@pytest.mark.parametrize("schedule, v", [("1f1b", 1), ("interleaved_zb", 2), ("zbv", 2), ("dualpipev", 2)])
def test_replaying_a_timeline_reproduces_its_step(schedule, v):
    # uneven stages, a head on the last: a recorded step is replayed from its own actions' times
    n = 2 * v
    costs = Costs(tuple(1.0 + s for s in range(n)), tuple(2.0 + s for s in range(n)),
                  tuple(1.2 + s for s in range(n)), tuple(0.9 + s / 2 for s in range(n)), message=0.0)  # fmt: skip
    sim = simulate(schedule, 2, 8, costs, v)
    assert replay(sim.timeline, schedule, 2, 8, v).step_s == pytest.approx(sim.step_s)
