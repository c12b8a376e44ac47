"""``PipelineMonitor``: what the pipeline did, per step: throughput, bubble, per-stage compute time."""

from __future__ import annotations

import json
import time
from pathlib import Path
from typing import Any

import lightning as L
import torch.distributed as dist
from lightning.pytorch.callbacks import Callback

from lightning_pp.runtime.recompiles import dynamo_counts
from lightning_pp.runtime.telemetry import Event, chrome_trace, gantt_png, summarize
from lightning_pp.split.microbatch import batch_size_of, tokens_in
from lightning_pp.strategy import PipelineStrategy


class PipelineMonitor(Callback):
    """Times every training step's schedule on every rank and logs, per step:

    ``pipeline/samples_per_s`` (and ``pipeline/tokens_per_s`` for (batch, sequence) token batches),
    ``pipeline/bubble`` (mean over stages of the time a stage waits on its peers / step time) and
    ``pipeline/stage{s}_compute_s``; with compiled blocks, ``pipeline/compiled_graphs`` and ``pipeline/eager_frames``
    (dynamo's graphs, and frames it ran eagerly, summed over ranks since the start: flat after the warm-up). At
    the end of fit it writes the last step's timeline as ``pipeline_trace.json`` (Chrome/Perfetto) and
    ``pipeline_schedule.png`` (Gantt chart) into ``dirpath`` (default: the trainer's log directory). Step time is the
    wall time between consecutive training-batch ends, optimizer step included.
    """

    def __init__(self, dirpath: str | Path | None = None) -> None:
        self.dirpath = dirpath
        self.last_events: list[Event] = []
        self._last_end: float | None = None

    def on_train_batch_start(self, trainer: L.Trainer, pl_module: L.LightningModule, batch: Any, batch_idx: int):
        if isinstance(trainer.strategy, PipelineStrategy):
            trainer.strategy.record_next_step = True

    def on_train_batch_end(
        self, trainer: L.Trainer, pl_module: L.LightningModule, outputs: Any, batch: Any, batch_idx: int
    ) -> None:
        if not isinstance(trainer.strategy, PipelineStrategy):
            return
        now = time.time()
        gathered: list[tuple[list[Event], tuple[int, int]]] = [([], (0, 0))] * trainer.world_size
        dist.all_gather_object(gathered, (trainer.strategy.last_step_events, dynamo_counts()))
        # one pipeline replica is enough: the stages of replica 0
        mine = [e for rank_events, _ in gathered[: trainer.strategy.layout.pp] for e in rank_events]
        previous, self._last_end = self._last_end, now
        if not mine or previous is None:
            return
        step_s = now - previous
        self.last_events = mine
        samples = batch_size_of(batch) * trainer.strategy.layout.dp
        values = {"pipeline/samples_per_s": samples / step_s}
        tokens = tokens_in(batch)
        if tokens is not None:
            values["pipeline/tokens_per_s"] = tokens * trainer.strategy.layout.dp / step_s
        summaries = summarize(mine)
        values["pipeline/bubble"] = sum(s.wait_s for s in summaries) / len(summaries) / step_s
        for s in summaries:
            values[f"pipeline/stage{s.stage}_compute_s"] = s.compute_s
        graphs, eager = (sum(counts) for counts in zip(*(counts for _, counts in gathered)))
        if graphs or eager:  # compiled blocks: flat after the warm-up, or something recompiles (or fell back)
            values.update({"pipeline/compiled_graphs": graphs, "pipeline/eager_frames": eager})
        for name, value in values.items():
            pl_module.log(name, value, on_step=True, on_epoch=False)

    def on_fit_end(self, trainer: L.Trainer, pl_module: L.LightningModule) -> None:
        # trainer.log_dir broadcasts: every rank must ask for it
        out = Path(self.dirpath or trainer.log_dir or trainer.default_root_dir)
        if not trainer.is_global_zero or not self.last_events:
            return
        out.mkdir(parents=True, exist_ok=True)
        (out / "pipeline_trace.json").write_text(json.dumps(chrome_trace(self.last_events)))
        try:
            schedule = getattr(trainer.strategy, "schedule", "")
            gantt_png(self.last_events, out / "pipeline_schedule.png", title=f"{schedule}: last measured step")
        except ImportError:  # matplotlib is an optional extra
            pass
