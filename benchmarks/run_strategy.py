"""One timed run of the GPT through ``Trainer(strategy=PipelineStrategy(...))`` (launch with torchrun).

Writes the wall times between consecutive training-batch ends on rank 0 to the JSON file given.
"""

from __future__ import annotations

import json
import sys
import time

import lightning as L
from common import MODEL, batches, pipeline_trainer
from torch.utils.data import DataLoader

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
    trainer = pipeline_trainer(schedule, m, steps, ends)
    trainer.fit(GPT(**MODEL), loader)
    if trainer.global_rank == 0:
        with open(out, "w") as f:
            json.dump({"ends": ends.ends}, f)
