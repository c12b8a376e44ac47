"""Timestamps of what a stage did during one step: compute (forward, backward per micro-batch) and waits.

Compute is timed around the stage's ``forward_one_chunk``/``backward_one_chunk`` (and the loss);
communication (preparing, posting and waiting for sends and receives) around the stage's
``get_*_ops`` and torch's ``_batch_p2p``/``_sorted_batch_p2p``/``_wait_batch_p2p``, through which every schedule
exchanges activations and gradients. Wall-clock times
(``time.time``) so that events of different ranks on one machine share a time axis.
"""

from __future__ import annotations

import contextlib
import time
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from typing import Any

from torch.distributed.pipelining import schedules

COMPUTE = "FBIWL"


@dataclass(frozen=True)
class Event:
    stage: int  # the rank's position in the pipeline: its stage when it holds one
    # "F" forward, "B" backward, "I" and "W" its input and weight halves (zero-bubble and V schedules), "L" loss
    # (the user's step), "P" communicating (posting or waiting)
    kind: str
    microbatch: int
    start: float
    end: float
    chunk: int = 0  # which of the rank's stages (0: its first; multi-stage schedules hold several)

    @property
    def seconds(self) -> float:
        return self.end - self.start


class StepRecorder:
    """Collects events while ``recording`` is active; costs one attribute check otherwise."""

    def __init__(self, stage: int) -> None:
        self.stage = stage
        self.events: list[Event] | None = None

    def instrument(self, pipeline_stage: Any, schedule: Any, chunk: int = 0) -> None:
        """Time ``pipeline_stage``, the rank's ``chunk``-th stage, under ``schedule``."""
        # zero-bubble schedules split backward: input gradients (full_backward=False), then weight gradients
        timed = {"forward_one_chunk": "F", "backward_one_chunk": "B", "backward_weight_one_chunk": "W"}
        for name in ("get_fwd_recv_ops", "get_fwd_send_ops", "get_bwd_recv_ops", "get_bwd_send_ops"):
            timed[name] = "P"
        for name, kind in timed.items():
            setattr(pipeline_stage, name, self._timed(kind, getattr(pipeline_stage, name), 0, chunk))
        if pipeline_stage.is_last:  # the loss, i.e. the user's step, runs outside the stage's forward
            schedule._maybe_compute_loss = self._timed("L", schedule._maybe_compute_loss, 3, chunk)

    def _timed(self, kind: str, method: Callable[..., Any], mb_arg: int, chunk: int) -> Callable[..., Any]:
        def run(*args: Any, **kwargs: Any) -> Any:
            # torch asks every forward whether it ends in a loss: only the last stage's calls compute one
            if self.events is None or (kind == "L" and not args[0].is_last):
                return method(*args, **kwargs)
            start = time.time()
            out = method(*args, **kwargs)
            microbatch = int(args[mb_arg]) if kind != "P" else -1
            now = "I" if kind == "B" and kwargs.get("full_backward", True) is False else kind
            self.events.append(Event(self.stage, now, microbatch, start, time.time(), chunk))
            return out

        return run

    @contextlib.contextmanager
    def recording(self) -> Iterator[list[Event]]:
        self.events = events = []
        originals = {name: getattr(schedules, name) for name in ("_batch_p2p", "_sorted_batch_p2p", "_wait_batch_p2p")}

        def timed(function: Callable[..., Any]) -> Callable[..., Any]:
            def run(*args: Any, **kwargs: Any) -> Any:
                start = time.time()
                out = function(*args, **kwargs)
                events.append(Event(self.stage, "P", -1, start, time.time()))
                return out

            return run

        for name, function in originals.items():
            setattr(schedules, name, timed(function))
        try:
            yield events
        finally:
            for name, function in originals.items():
                setattr(schedules, name, function)
            self.events = None


@dataclass(frozen=True)
class StageSummary:
    stage: int
    compute_s: float
    wait_s: float
    span_s: float  # first forward start to last backward end


def summarize(events: list[Event]) -> list[StageSummary]:
    out = []
    for stage in sorted({e.stage for e in events}):
        mine = [e for e in events if e.stage == stage]
        compute = [e for e in mine if e.kind in COMPUTE]
        if not compute:
            continue
        start, end = min(e.start for e in compute), max(e.end for e in compute)
        waits = covered([(e.start, e.end) for e in mine if e.kind == "P"], start, end)
        out.append(StageSummary(stage, sum(e.seconds for e in compute), waits, end - start))
    return out


def covered(intervals: list[tuple[float, float]], start: float, end: float) -> float:
    """Seconds of [start, end] inside the union of the intervals (nested timers count once)."""
    total, reach = 0.0, start
    for a, b in sorted(intervals):
        a, b = max(a, reach), min(b, end)
        if b > a:
            total += b - a
            reach = b
    return total


def chrome_trace(events: list[Event]) -> dict[str, Any]:
    """Chrome/Perfetto trace: one row (tid) per stage, times in microseconds from the first event."""
    if not events:
        return {"traceEvents": []}
    t0 = min(e.start for e in events)
    names = {"F": "forward", "B": "backward", "I": "input backward", "W": "weight backward", "L": "loss", "P": "wait"}
    return {
        "traceEvents": [
            {
                "name": "wait" if e.kind == "P" else f"{e.kind}{e.microbatch}" + "'" * e.chunk,
                "cat": names[e.kind],
                "ph": "X",
                "pid": 0,
                "tid": e.stage,
                "ts": (e.start - t0) * 1e6,
                "dur": e.seconds * 1e6,
                "args": {"stage": e.stage, "microbatch": e.microbatch, "chunk": e.chunk},
            }
            for e in sorted(events, key=lambda e: (e.stage, e.start))
        ],
        "displayTimeUnit": "ms",
    }


def gantt_png(events: list[Event], path: Any, title: str = "") -> None:
    """One row per pipeline rank (its stage under GPipe and 1F1B); forward and backward coloured,
    micro-batch numbers on the bars, primed on a rank's second stage (interleaved and V schedules)."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    compute = [e for e in events if e.kind in COMPUTE]
    t0 = min(e.start for e in compute)
    rows = sorted({e.stage for e in compute})
    several = any(e.chunk for e in compute)
    fig, ax = plt.subplots(figsize=(8, 0.7 * len(rows) + 1.2))
    colors = {"F": ("#4C72B0", "#8FAADC"), "B": ("#DD8452", "#F0B98D"), "I": ("#DD8452", "#F0B98D"),
              "W": ("#8172B3", "#B9AEDB"), "L": ("#55A868", "#8FD19E")}  # fmt: skip
    for e in compute:
        color = colors[e.kind][min(e.chunk, 1)]
        ax.barh(e.stage, e.seconds * 1e3, left=(e.start - t0) * 1e3, color=color, edgecolor="white")
        ax.text((e.start - t0 + e.seconds / 2) * 1e3, e.stage, f"{e.microbatch}" + "'" * e.chunk, ha="center",
                va="center", color="white", fontsize=7)  # fmt: skip
    ax.set_yticks(rows, [f"rank {r}" if several else f"stage {r}" for r in rows])
    ax.invert_yaxis()
    ax.set_xlabel("ms since the step's first forward")
    legend = "blue: forward, green: loss, orange: backward (or its input half), purple: its weight half"
    legend += "; numbers: micro-batch"
    if several:
        legend += ", light and primed: the rank's second stage"
    ax.set_title(f"{title}\n({legend})".strip(), fontsize=9)
    fig.tight_layout()
    fig.savefig(path, dpi=120)
    plt.close(fig)
