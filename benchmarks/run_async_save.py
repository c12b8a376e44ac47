"""One rank of a save-stall run: the example GPT at the large-model size (151 M parameters), 1F1B, SGD, a sharded
checkpoint every few steps, synchronous or in the background; or a restart: rank 1 killed once, torchrun
starting the job again from its last checkpoint. Rank 0 writes every step's end time (and, for a restart,
the moment of the kill and the end of the restarted attempt's first step).

    torchrun --nproc_per_node P [--max-restarts 1] run_async_save.py MODE DIR OUT     (MODE: sync | async | restart)
"""

from __future__ import annotations

import json
import os
import signal
import sys
import time

import lightning as L
import torch
from common import LARGE
from lightning.pytorch.callbacks import Callback, ModelCheckpoint
from torch.utils.data import DataLoader

from lightning_pp import PipelineStrategy
from lightning_pp.examples.gpt import GPT

EVERY = 4  # steps between saves
STEPS = 20
KILL_STEP = 7  # restart: rank 1 dies before this step, in the first attempt


class SGDGPT(GPT):
    def configure_optimizers(self):
        return torch.optim.SGD(self.parameters(), lr=1e-3)


class Steps(Callback):
    def __init__(self, out: str, mode: str) -> None:
        self.out, self.mode, self.ends = out, mode, []
        self.attempt = int(os.environ.get("TORCHELASTIC_RESTART_COUNT", "0"))

    def on_train_batch_start(self, trainer, pl_module, batch, batch_idx) -> None:
        if self.mode == "restart" and self.attempt == 0 and trainer.global_step == KILL_STEP:
            if trainer.global_rank == 1:
                with open(self.out + ".kill", "w") as f:
                    f.write(str(time.time()))
                os.kill(os.getpid(), signal.SIGKILL)

    def on_train_batch_end(self, trainer, *args) -> None:
        self.ends.append(time.perf_counter())
        if self.mode == "restart" and self.attempt == 1 and len(self.ends) == 1 and trainer.global_rank == 0:
            with open(self.out + ".first", "w") as f:
                f.write(str(time.time()))

    def on_train_end(self, trainer, pl_module) -> None:
        if trainer.global_rank == 0 and self.mode != "restart":
            with open(self.out, "w") as f:
                json.dump({"ends": self.ends, "every": EVERY}, f)


if __name__ == "__main__":
    mode, directory, out = sys.argv[1:4]
    ranks = int(os.environ["WORLD_SIZE"])
    strategy = PipelineStrategy(schedule="1f1b", n_microbatches=ranks, state_dict_type="sharded",
                                async_save=mode == "async")  # fmt: skip
    every = 2 if mode == "restart" else EVERY
    save = ModelCheckpoint(dirpath=directory, every_n_train_steps=every, save_top_k=1, save_last=mode == "restart")
    trainer = L.Trainer(accelerator="cpu", devices=ranks, strategy=strategy, max_steps=STEPS, logger=False,
                        callbacks=[Steps(out, mode), save], enable_progress_bar=False, enable_model_summary=False,
                        num_sanity_val_steps=0)  # fmt: skip
    model_cfg = {k: LARGE[k] for k in ("vocab", "dim", "n_layers", "n_heads", "seq_len")}
    with trainer.init_module(empty_init=True):
        model = SGDGPT(**model_cfg)
    g = torch.Generator().manual_seed(0)
    data = torch.randint(0, LARGE["vocab"], (STEPS * 4 * ranks, LARGE["seq_len"] + 1), generator=g)
    loader = DataLoader(list(zip(data[:, :-1], data[:, 1:])), batch_size=4 * ranks)
    trainer.fit(model, loader, ckpt_path="last" if mode == "restart" else None)
