"""One run of benchmarks/fault_tolerance.py, on every rank (under torchrun): a 2-stage GPT, either one torchft
replica group (``mode: ft``) or one job of two DDP replicas that checkpoints every ``every`` steps and resumes from
its last checkpoint when torchrun restarts it (``mode: restart``). ``kill`` [rank, step]: that rank SIGKILLs itself
in its first attempt as that step begins. Each rank appends ``{step, attempt, time}`` per batch end to
``OUT/times_{tag}_{rank}.jsonl``.
"""

from __future__ import annotations

import json
import os
import signal
import sys
import time
from pathlib import Path

import lightning as L
import torch
from lightning.pytorch.callbacks import Callback, ModelCheckpoint
from torchdata.stateful_dataloader import StatefulDataLoader

import lightning_pp
from lightning_pp.examples.data import Progressions
from lightning_pp.examples.gpt import GPT

ATTEMPT = int(os.environ.get("TORCHELASTIC_RESTART_COUNT", "0"))


class Times(Callback):
    def __init__(self, cfg: dict) -> None:
        self.cfg, self.rank = cfg, int(os.environ["RANK"])
        self.path = Path(cfg["out"]) / f"times_{cfg['tag']}_{self.rank}.jsonl"

    def on_train_batch_start(self, trainer, pl_module, batch, batch_idx):
        if self.cfg.get("kill") == [self.rank, trainer.global_step] and ATTEMPT == 0:
            os.kill(os.getpid(), signal.SIGKILL)

    def on_train_batch_end(self, trainer, pl_module, outputs, batch, batch_idx):
        with self.path.open("a") as f:
            f.write(json.dumps({"step": trainer.global_step, "attempt": ATTEMPT, "time": time.time()}) + "\n")


def main(cfg: dict) -> None:
    torch.set_num_threads(1)
    L.seed_everything(0, verbose=False)
    model = GPT(dim=cfg["dim"], n_layers=4, seq_len=cfg["seq"])
    data = StatefulDataLoader(Progressions(4096, cfg["seq"]), batch_size=cfg["batch"], shuffle=True)
    callbacks: list[Callback] = [Times(cfg)]
    resume = None
    if cfg["mode"] == "ft":
        ft = {"group": cfg["group"], "groups": 2, "lighthouse": cfg["lighthouse"], "timeout": 30,
              "hostname": "127.0.0.1"}  # fmt: skip
        strategy = lightning_pp.PipelineStrategy(schedule="1f1b", fault_tolerance=ft, timeout=30)
    else:
        strategy = lightning_pp.PipelineStrategy(schedule="1f1b", pipeline_parallel_size=2, timeout=30)
        saves = Path(cfg["out"]) / f"checkpoints_{cfg['tag']}"
        callbacks.append(ModelCheckpoint(saves, every_n_train_steps=cfg["every"], save_last=True, save_top_k=-1))
        resume = "last" if (saves / "last.ckpt").exists() else None
    trainer = L.Trainer(
        accelerator="cpu", devices=cfg["devices"], strategy=strategy, max_steps=cfg["steps"], logger=False,
        enable_progress_bar=False, enable_model_summary=False, num_sanity_val_steps=0, limit_val_batches=0,
        callbacks=callbacks, enable_checkpointing=cfg["mode"] != "ft",
    )  # fmt: skip
    trainer.fit(model, data, ckpt_path=resume)


if __name__ == "__main__":
    main(json.loads(sys.argv[1]))
