"""``PipelineMonitor``: what the pipeline did, per step: throughput, bubble, per-stage compute time.
``GenerateSamples``: what the model writes while it trains."""

from __future__ import annotations

import csv
import json
import time
from pathlib import Path
from typing import Any

import lightning as L
import torch
import torch.distributed as dist
from lightning.pytorch.callbacks import Callback
from lightning.pytorch.loggers import TensorBoardLogger

from lightning_pp.errors import PipelineConfigError
from lightning_pp.generation.stages import check_generates

from lightning_pp.runtime.recompiles import dynamo_counts
from lightning_pp.runtime.telemetry import Event, chrome_trace, gantt_png, summarize
from lightning_pp.split.microbatch import batch_size_of, tokens_in
from lightning_pp.split.stage import resolve_layers
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


class GenerateSamples(Callback):
    """Samples from the model through the pipeline while it trains, logged where a reader looks.

    Every ``every_n_val``-th validation run (or, with ``every_n_epochs``, at the end of every such training
    epoch) every rank calls ``strategy.generate`` on ``prompts`` (strings with a ``tokenizer``, or lists of
    token ids, left-padded here with ``pad_token_id``); rank 0 logs each prompt and its continuation: a table
    where the logger takes one (``log_table``: W&B), text on TensorBoard (``samples``), rows of ``samples.csv``
    beside a CSV logger's metrics. ``sampling``: ``generate``'s other arguments (``do_sample``, ``seed``, ...).
    ``samples`` keeps every (step, texts) this run made.
    """

    def __init__(
        self,
        prompts: list[Any],
        every_n_val: int = 1,
        every_n_epochs: int | None = None,
        max_new_tokens: int = 32,
        tokenizer: Any = None,
        pad_token_id: int = 0,
        **sampling: Any,
    ) -> None:
        if not prompts or (tokenizer is None and any(isinstance(p, str) for p in prompts)):
            raise PipelineConfigError(
                f"GenerateSamples(prompts={prompts!r}): pass lists of token ids, or strings with a tokenizer."
            )
        self.prompts, self.tokenizer, self.pad = list(prompts), tokenizer, pad_token_id
        self.every_n_val, self.every_n_epochs = every_n_val, every_n_epochs
        self.sampling = {"max_new_tokens": max_new_tokens, "pad_token_id": pad_token_id, **sampling}
        self.samples: list[tuple[int, list[str]]] = []
        self._validations = 0

    def setup(self, trainer: L.Trainer, pl_module: L.LightningModule, stage: str) -> None:
        if not isinstance(trainer.strategy, PipelineStrategy):
            raise PipelineConfigError(
                f"GenerateSamples samples through PipelineStrategy; this Trainer's strategy is"
                f" {type(trainer.strategy).__name__}."
            )
        check_generates(pl_module, resolve_layers(pl_module, trainer.strategy.options.layers))

    def on_validation_epoch_end(self, trainer: L.Trainer, pl_module: L.LightningModule) -> None:
        if trainer.sanity_checking or trainer.state.fn != "fit" or self.every_n_epochs is not None:
            return
        self._validations += 1
        if self._validations % self.every_n_val == 0:
            self.sample(trainer)

    def on_train_epoch_end(self, trainer: L.Trainer, pl_module: L.LightningModule) -> None:
        if self.every_n_epochs is not None and (trainer.current_epoch + 1) % self.every_n_epochs == 0:
            self.sample(trainer)

    def sample(self, trainer: L.Trainer) -> list[str]:
        """Generate now (on every rank) and log; the continuations as text."""
        ids, mask = self._encoded()
        out = trainer.strategy.generate(ids, mask, **self.sampling)
        texts = self._decoded(out[:, ids.shape[1] :])
        self.samples.append((trainer.global_step, texts))
        if trainer.is_global_zero:
            prompts = [p if isinstance(p, str) else " ".join(map(str, p)) for p in self.prompts]
            _log_samples(trainer, trainer.global_step, list(zip(prompts, texts)))
        return texts

    def _encoded(self) -> tuple[torch.Tensor, torch.Tensor]:
        if self.tokenizer is not None and isinstance(self.prompts[0], str):
            encoded = self.tokenizer(self.prompts, return_tensors="pt", padding=True, padding_side="left")
            return encoded["input_ids"], encoded["attention_mask"]
        width = max(len(p) for p in self.prompts)
        ids = torch.full((len(self.prompts), width), self.pad, dtype=torch.long)
        mask = torch.zeros_like(ids)
        for row, prompt in enumerate(self.prompts):
            ids[row, width - len(prompt) :] = torch.tensor(prompt, dtype=torch.long)
            mask[row, width - len(prompt) :] = 1
        return ids, mask

    def _decoded(self, new: torch.Tensor) -> list[str]:
        if self.tokenizer is not None:
            return list(self.tokenizer.batch_decode(new, skip_special_tokens=True))
        return [" ".join(str(int(t)) for t in row) for row in new]


def _log_samples(trainer: L.Trainer, step: int, rows: list[tuple[str, str]]) -> None:
    for logger in trainer.loggers:
        if hasattr(logger, "log_table"):
            logger.log_table(key="samples", columns=["step", "prompt", "sample"], data=[[step, *r] for r in rows])
        elif isinstance(logger, TensorBoardLogger):
            table = "\n".join(f"| {p} | {s} |" for p, s in rows)
            logger.experiment.add_text("samples", f"| prompt | sample |\n|---|---|\n{table}", step)
        elif logger.log_dir is not None:
            path = Path(logger.log_dir) / "samples.csv"
            path.parent.mkdir(parents=True, exist_ok=True)
            new = not path.exists()
            with path.open("a", newline="") as f:
                writer = csv.writer(f)
                if new:
                    writer.writerow(["step", "prompt", "sample"])
                writer.writerows([step, *r] for r in rows)
