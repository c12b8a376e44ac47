"""Peak bytes of activations saved for backward, per stage, through the Trainer (launch with torchrun).

Saved-tensor hooks around each training step count every saved storage once while it is alive;
parameters (and views of them) are excluded. The first step is left out: it also runs torch's
shape inference (an extra forward). Counted from each step's start; what is still alive from
earlier steps is reported apart (torch 2.13's shape inference leaves one micro-batch of a first
stage's activations alive for good, raw torch alike). Rank 0 writes every stage's numbers to the
JSON file given.
"""

from __future__ import annotations

import gc
import json
import sys

import lightning as L
import torch
import torch.distributed as dist
from common import MODEL, batches, pipeline_trainer
from torch.utils.data import DataLoader

from lightning_pp.examples.gpt import GPT


class SavedActivations(L.Callback):
    def __init__(self) -> None:
        self.live: dict[int, list[int]] = {}  # storage pointer -> [bytes, references]
        self.current = self.peak = 0
        self.held = 0  # alive when the step started
        self.steps = 0
        self._hooks = None

    def _pack(self, tensor: torch.Tensor):
        storage = tensor.untyped_storage()
        key = storage.data_ptr()
        if key in self._params:
            return tensor
        entry = self.live.setdefault(key, [storage.nbytes(), 0])
        if entry[1] == 0:
            self.current += entry[0]
            if self.steps > 1:
                self.peak = max(self.peak, self.current - self.held)
        entry[1] += 1
        return _Saved(self, key, tensor)

    def _release(self, key: int) -> None:
        entry = self.live[key]
        entry[1] -= 1
        if entry[1] == 0:
            self.current -= entry[0]
            del self.live[key]

    def on_train_batch_start(self, trainer, pl_module, batch, batch_idx) -> None:
        self.steps += 1
        gc.collect()  # what only a cycle keeps (freed at the collector's next run, whenever that is) is not held
        self.held = self.current
        self._params = {p.untyped_storage().data_ptr() for p in pl_module.parameters()}
        self._hooks = torch.autograd.graph.saved_tensors_hooks(self._pack, _unpack)
        self._hooks.__enter__()

    def on_train_batch_end(self, *args) -> None:
        self._hooks.__exit__(None, None, None)


def _unpack(saved: object) -> torch.Tensor:
    return saved.tensor if isinstance(saved, _Saved) else saved  # type: ignore[return-value]


class _Saved:
    def __init__(self, owner: SavedActivations, key: int, tensor: torch.Tensor) -> None:
        # detached: a saved output holding its own grad_fn would make a cycle through autograd's C++ graph that
        # nothing frees where a split backward retains the graph (zero-bubble and V schedules)
        self.owner, self.key, self.tensor = owner, key, tensor.detach()

    def __del__(self) -> None:
        self.owner._release(self.key)


if __name__ == "__main__":
    schedule, m, steps, out = sys.argv[1], int(sys.argv[2]), int(sys.argv[3]), sys.argv[4]
    recompute = len(sys.argv) > 5 and sys.argv[5] == "recompute"
    L.seed_everything(0, verbose=False)
    saved = SavedActivations()
    trainer = pipeline_trainer(schedule, m, steps, [saved], activation_checkpointing=recompute)
    trainer.fit(GPT(**MODEL), DataLoader(batches(steps), batch_size=None))
    measured = [(0, 0)] * trainer.world_size
    dist.all_gather_object(measured, (saved.peak, saved.held))
    if trainer.global_rank == 0:
        with open(out, "w") as f:
            json.dump(
                {"peak_bytes_per_stage": [p for p, _ in measured], "held_bytes_per_stage": [h for _, h in measured]}, f
            )
