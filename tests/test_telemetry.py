"""PipelineMonitor reports what the schedule must have done (not how fast it was)."""

from __future__ import annotations

import json
import statistics

import pytest
from conftest import ok, run_job

from lightning_pp.choose.simulate import replay
from lightning_pp.runtime.telemetry import Event

M = 4


def stage_events(trace: dict, stage: int) -> list[dict]:
    return sorted((e for e in trace["traceEvents"] if e["tid"] == stage), key=lambda e: e["ts"])


def serial_work(events: list[Event], rank: int) -> float:
    """``rank``'s actions at the medians of their stage and kind, back to back: no schedule runs them in less."""
    groups: dict[tuple[int, str], list[float]] = {}
    for e in events:
        if e.stage == rank:
            groups.setdefault((e.chunk, e.kind), []).append(e.seconds)
    return sum(len(seconds) * statistics.median(seconds) for seconds in groups.values())


def expected_order(schedule: str, stage: int, stages: int, m: int) -> list[str]:
    if schedule == "gpipe":
        return [f"F{i}" for i in range(m)] + [f"B{i}" for i in range(m)]
    warmup = min(m, stages - stage)  # 1F1B: warm-up forwards, then one backward one forward, then cool-down
    order, f, b = [f"F{i}" for i in range(warmup)], warmup, 0
    while b < m:
        order.append(f"B{b}")
        b += 1
        if f < m:
            order.append(f"F{f}")
            f += 1
    return order


@pytest.mark.parametrize("schedule", ["gpipe", "1f1b", "zbv"])
def test_timeline_follows_the_schedule(tmp_path, schedule):
    # micro-batches large enough that compute, not the schedule's Python glue, fills the span
    job = ok(run_job(dict(strategy="pipeline", devices=2, schedule=schedule, m=M, batch=128, n_train=768,
                          monitor_pipeline=True), tmp_path / "job"))  # fmt: skip
    trace = json.loads((job.out / "pipeline_trace.json").read_text())
    assert (job.out / "pipeline_schedule.png").stat().st_size > 5_000
    for stage in range(2):
        events = stage_events(trace, stage)
        compute = [
            e for e in events if e["cat"] in ("forward", "backward", "input backward", "weight backward", "loss")
        ]
        kinds = [e["cat"] for e in compute]
        if schedule == "zbv":  # two stages per rank (a V) whose backwards split into input and weight halves
            assert kinds.count("forward") == kinds.count("input backward") == kinds.count("weight backward") == 2 * M
            assert "backward" not in kinds and kinds.count("loss") == (M if stage == 0 else 0)  # last stage: rank 0
        else:
            names = [e["name"] for e in compute if e["cat"] != "loss"]
            assert sum(n.startswith("F") for n in names) == M and sum(n.startswith("B") for n in names) == M
            assert names == expected_order(schedule, stage, 2, M)
            assert kinds.count("loss") == (M if stage == 1 else 0)  # the user's step, on the last stage
        for a, b in zip(compute, compute[1:]):  # one stage computes one thing at a time
            assert a["ts"] + a["dur"] <= b["ts"] + 1e-3
        span = compute[-1]["ts"] + compute[-1]["dur"] - compute[0]["ts"]
        busy = sum(e["dur"] for e in compute)
        start, end = compute[0]["ts"], compute[-1]["ts"] + compute[-1]["dur"]
        waits = sorted((e["ts"], e["ts"] + e["dur"]) for e in events if e["cat"] == "wait")
        waited, reach = 0.0, start  # union of the (possibly nested) communication intervals
        for a, b in waits:
            a, b = max(a, reach), min(b, end)
            if b > a:
                waited, reach = waited + b - a, b
        # compute and waits never overlap (exact); what they leave unaccounted is the schedule's glue, 1.5-4.3% alone,
        # plus any time the OS takes the core away: 12.5% and 16.6% seen on a 2-vCPU VM under a neighbour's load
        assert busy + waited <= span * 1.001, (stage, busy, waited, span)
        assert busy + waited >= 0.7 * span, (stage, busy, waited, span)
        print(f"{schedule} stage {stage}: unaccounted {1 - (busy + waited) / span:.1%} of the span")
    # the simulator replays the step from the medians of what each action took: never longer than the step measured
    # (it leaves out each send's and receive's own time), never shorter than the busiest rank's actions run back to
    # back at those medians. How much of the step it explains (0.52-0.85 on a quiet 2-core machine, 0.28 seen when
    # the OS took a core away mid-step) is a measurement, the planner's benchmark's to report, not this test's.
    recorded = [Event(e["tid"], e["name"][0] if e["cat"] != "wait" else "P", e["args"]["microbatch"], e["ts"] * 1e-6,
                      (e["ts"] + e["dur"]) * 1e-6, e["args"]["chunk"]) for e in trace["traceEvents"]]  # fmt: skip
    computed = [e for e in recorded if e.kind != "P"]
    measured = max(e.end for e in computed) - min(e.start for e in computed)
    replayed = replay(recorded, schedule, 2, M, 2 if schedule == "zbv" else 1).step_s
    print(f"{schedule}: replayed step {replayed:.4f} s of {measured:.4f} s measured")
    assert max(serial_work(computed, rank) for rank in range(2)) <= replayed * (1 + 1e-9)
    assert replayed <= 1.02 * measured
    logged = [r for r in job.rank(0)["logged"] if "pipeline/bubble" in r]
    assert logged and all(0 <= r["pipeline/bubble"] < 1 and r["pipeline/samples_per_s"] > 0 for r in logged)
    assert all(r["pipeline/stage1_compute_s"] > 0 for r in logged)
