"""One timed run of the GPT through ``Trainer(strategy=PipelineStrategy(...))`` (launch with torchrun).

    run_strategy.py SCHEDULE M STEPS OUT [OPTIONS_JSON]

SCHEDULE and M may be ``auto`` (``PipelineStrategy(schedule="auto")`` leaves the micro-batches, balance and stages
per rank unset unless OPTIONS_JSON gives them, so the first batch chooses them too). OPTIONS_JSON may set ``shape``
(a model of ``shapes.py``, the GPT by default), ``balance``, ``stages_per_rank``, ``vocab`` (a heavier head),
``activation_checkpointing``, ``compile``, ``memory_limit``, ``monitor`` (PipelineMonitor on: the measured bubble of
each step is written too), ``timeline`` (a PNG path: the Gantt chart of two consecutive steps before the last) and
``syncs`` (on CUDA: each step's device-to-host synchronisations on every rank, as ``torch.cuda.set_sync_debug_mode``
reports them, and the Python lines they came from). On CUDA each step's end waits for its kernels, as the raw
script's does.
Writes the wall times between consecutive training-batch ends on rank 0 (and the first batch's start) to the JSON
file OUT, every rank's minor page faults and system CPU seconds at each of them, and every rank's peak resident
memory growth during ``fit`` (and the absolute peak, and the resident memory before ``fit``); with something given
as "auto", the options the first batch chose (``trainer.strategy.options`` on rank 0) and what rank 0 logged of the
plan.
"""

from __future__ import annotations

import collections
import json
import logging
import re
import sys
import time
import warnings
from typing import Any

import lightning as L
import torch
from common import MODEL, batches, pipeline_trainer, proc_kib, time_schedules, usage
from shapes import build, data
from torch.utils.data import DataLoader

from lightning_pp import PipelineMonitor
from lightning_pp.choose.auto import CHOSEN
from lightning_pp.examples.gpt import GPT
from lightning_pp.runtime.telemetry import gantt_png


class LastTwoSteps(L.Callback):
    """Every rank's timed events of the two training steps before the last (which drains a 2BW stream), drawn on
    rank 0 at the end."""

    def __init__(self, path: str) -> None:
        self.path, self.steps = path, []

    def on_train_batch_start(self, trainer, *args) -> None:
        trainer.strategy.record_next_step = True

    def on_train_batch_end(self, trainer, *args) -> None:
        events: list = [None] * trainer.world_size
        torch.distributed.all_gather_object(events, trainer.strategy.last_step_events)
        self.steps = [*self.steps[-2:], [e for rank in events for e in rank]]

    def on_fit_end(self, trainer, *args) -> None:
        if trainer.is_global_zero:
            title = f"{trainer.strategy.schedule}: two consecutive steps"
            gantt_png([e for step in self.steps[:2] for e in step], self.path, title=title)


class BatchEnds(L.Callback):
    def __init__(self, count_syncs: bool = False) -> None:
        self.start: float | None = None  # the first training batch's start (its step compiles)
        self.ends: list[float] = []
        self.faults: list[tuple[int, float]] = []
        self.bubbles: list[float] = []
        self.syncs: list[int] | None = [] if count_syncs else None  # per step after the first, the loop's own too
        self.sync_lines: collections.Counter = collections.Counter()
        self._caught: Any = None  # a warnings.catch_warnings while a step's syncs are counted
        self._records: list = []

    def on_train_batch_start(self, trainer, *args) -> None:
        self.start = self.start or time.perf_counter()

    def on_train_batch_end(self, trainer, *args) -> None:
        self._stop_counting()
        if trainer.strategy.root_device.type == "cuda":
            torch.cuda.synchronize(trainer.strategy.root_device)  # the step's kernels done, not only launched
        self.ends.append(time.perf_counter())
        self.faults.append(usage())
        if "pipeline/bubble" in trainer.callback_metrics:
            self.bubbles.append(float(trainer.callback_metrics["pipeline/bubble"]))
        if self.syncs is not None and trainer.strategy.root_device.type == "cuda":
            self._caught = warnings.catch_warnings(record=True)
            self._records = self._caught.__enter__()
            warnings.simplefilter("always")
            torch.cuda.set_sync_debug_mode("warn")

    def on_train_end(self, trainer, *args) -> None:
        self._stop_counting()

    def _stop_counting(self) -> None:
        if self._caught is None:
            return
        torch.cuda.set_sync_debug_mode("default")
        self._caught.__exit__(None, None, None)
        found = [w for w in self._records if "synchroniz" in str(w.message)]
        self.syncs.append(len(found))
        self.sync_lines.update(f"{w.filename}:{w.lineno}" for w in found)
        self._caught = None


class PlanLog(logging.Handler):
    """Rank 0's lines of schedule="auto": what it predicted of its choice and how long planning took, and what its
    first steps measured against that."""

    PATTERN = re.compile(
        r"chose .*?\(predicted step ([\d.]+) s, peak (\d+) MiB per rank\).*Planned in ([\d.]+) s over (\d+)"
    )
    CHECKED = re.compile(  # the strategy's own check after the first steps (lightning_pp.runtime.forecast)
        r"took ([\d.]+) s .*the highest peak was (\d+) MiB on rank (\d+) \(([+-]\d+)% of its predicted (\d+) MiB\)"
    )

    def __init__(self) -> None:
        super().__init__()
        self.found: dict = {}

    def emit(self, record: logging.LogRecord) -> None:
        line = record.getMessage()
        match = self.PATTERN.search(line)
        if match:
            step, peak, planned, n = match.groups()
            self.found.update({"predicted_step_s": float(step), "predicted_peak_mib": float(peak),
                               "planning_s": float(planned), "configurations": int(n), "line": line})  # fmt: skip
        checked = self.CHECKED.search(line)
        if checked:
            took, peak, rank, error, predicted = checked.groups()
            self.found["checked"] = {"step_s": float(took), "peak_mib": float(peak), "rank": int(rank),
                                     "peak_error": int(error) / 100, "predicted_peak_mib": float(predicted),
                                     "line": line}  # fmt: skip


if __name__ == "__main__":
    schedule, m, steps, out = sys.argv[1], sys.argv[2], int(sys.argv[3]), sys.argv[4]
    m = m if m == "auto" else int(m)
    plan_log = PlanLog()
    logging.getLogger("lightning.pytorch").addHandler(plan_log)
    options = json.loads(sys.argv[5]) if len(sys.argv) > 5 else {}
    shape = options.get("shape", "gpt")
    model = {**MODEL, "vocab": options.get("vocab", MODEL["vocab"])}
    L.seed_everything(0, verbose=False)
    net = GPT(**model) if shape == "gpt" else build(shape)
    loader = DataLoader(batches(steps, vocab=model["vocab"]) if shape == "gpt" else data(shape, steps), batch_size=None)
    ends = BatchEnds(count_syncs=options.get("syncs", False))
    callbacks = [PipelineMonitor(dirpath=options["monitor"]), ends] if options.get("monitor") else [ends]
    if options.get("timeline"):
        callbacks.append(LastTwoSteps(options["timeline"]))
    recompute = options.get("activation_checkpointing", False)
    trainer = pipeline_trainer(
        schedule, m, steps, callbacks, balance=options.get("balance"), activation_checkpointing=recompute,
        compile=options.get("compile", False), stages_per_rank=options.get("stages_per_rank"),
        memory_limit=options.get("memory_limit"),
    )  # fmt: skip
    open("/proc/self/clear_refs", "w").write("5")  # the peak from here
    before = proc_kib("VmRSS:")
    time_schedules()
    trainer.fit(net, loader)
    peaks: list = [None] * trainer.world_size
    torch.distributed.all_gather_object(peaks, (proc_kib("VmHWM:") - before) / 1024)
    absolute: list = [None] * trainer.world_size
    torch.distributed.all_gather_object(absolute, (proc_kib("VmHWM:") / 1024, before / 1024))
    faults: list = [None] * trainer.world_size
    torch.distributed.all_gather_object(faults, ends.faults)
    syncs: list = [None] * trainer.world_size
    torch.distributed.all_gather_object(syncs, (ends.syncs, dict(ends.sync_lines.most_common(12))))
    if trainer.global_rank == 0:
        with open(out, "w") as f:
            split = list(trainer.strategy.placement.counts)
            chosen = {name: getattr(trainer.strategy.options, name) for name in CHOSEN}
            json.dump({"start": ends.start, "ends": ends.ends, "faults": faults, "bubbles": ends.bubbles,
                       "layers_per_stage": split, "peak_mib": peaks, "hwm_mib": [a[0] for a in absolute],
                       "rss_before_fit_mib": [a[1] for a in absolute], "options": chosen,
                       "auto": sorted(trainer.strategy.options.auto), "plan": plan_log.found,
                       "syncs": [per_step for per_step, _ in syncs], "sync_lines": [lines for _, lines in syncs]},
                      f)  # fmt: skip
