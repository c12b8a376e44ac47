"""One timed run of the GPT through ``Trainer(strategy=PipelineStrategy(...))`` (launch with torchrun).

Writes the wall times between consecutive training-batch ends on rank 0 to the JSON file given.
"""

from __future__ import annotations

import json
import os
import sys
import time

import lightning as L
from common import MODEL, batches
from torch.utils.data import DataLoader

from lightning_pp import PipelineStrategy
from lightning_pp.examples.gpt import GPT


class BatchEnds(L.Callback):
    def __init__(self) -> None:
        self.ends: list[float] = []

    def on_train_batch_end(self, *args) -> None:
        self.ends.append(time.perf_counter())


if __name__ == "__main__":
    schedule, m, steps, out = sys.argv[1], int(sys.argv[2]), int(sys.argv[3]), sys.argv[4]
    L.seed_everything(0, verbose=False)
    data = batches(steps)
    loader = DataLoader(data, batch_size=None)
    ends = BatchEnds()
    trainer = L.Trainer(
        accelerator="cpu",
        devices=int(os.environ.get("LOCAL_WORLD_SIZE", 2)),
        strategy=PipelineStrategy(schedule=schedule, n_microbatches=m),
        max_steps=steps,
        logger=False,
        enable_checkpointing=False,
        enable_progress_bar=False,
        enable_model_summary=False,
        num_sanity_val_steps=0,
        callbacks=[ends],
    )
    trainer.fit(GPT(**MODEL), loader)
    if trainer.global_rank == 0:
        with open(out, "w") as f:
            json.dump({"ends": ends.ends}, f)
