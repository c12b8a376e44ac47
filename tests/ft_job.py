"""One torchft replica group: a 2-stage pipeline job that tests/test_fault_tolerance.py starts under torchrun.

``python -m torch.distributed.run --nproc_per_node 2 tests/ft_job.py '<json config>'``. Every rank appends
one line per batch to ``group{g}_rank{r}.jsonl``: the batch, ``global_step``, whether the step committed,
how many groups took part, a checksum of its weights after it. ``kill`` ([rank, step]): that rank
SIGKILLs itself inside that step in the first attempt. ``waits`` ([[batch, name], ...]): before that batch,
the rank waits for the file ``name``, which rank r of group g writes at each attempt's set-up
(``group{g}_attempt{a}_{r}``, before its first quorum) and after it (``group{g}_started{a}_{r}``);
``setup_waits`` ([name, ...]): the first attempt waits for them before its first quorum; ``pace`` ([[step, name],
...]): from that step on, a step each half second until the file exists. So the groups meet in the order a test wants,
and the restarted group meets a live one before it ends (torchft's lighthouse lets the groups of the last quorum
meet again at once, without waiting for one that is starting).
Each rank saves its stage's final state as ``group{g}_rank{r}.pt``; ``reference`` runs the same module on one
process over given batches.
"""

from __future__ import annotations

import json
import os
import signal
import sys
import time
import zlib
from pathlib import Path
from typing import Any

import lightning as L
import torch
from lightning.pytorch.callbacks import Callback
from torch.distributed.tensor import DTensor

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))

from models import TinyGPT, Tokens  # noqa: E402

import lightning_pp  # noqa: E402
from lightning_pp.layout.dtensors import local_tensor  # noqa: E402

ATTEMPT = int(os.environ.get("TORCHELASTIC_RESTART_COUNT", "0"))


class ScheduledGPT(TinyGPT):
    """TinyGPT with a learning rate that changes every optimizer step: schedulers must follow the commits.
    ``kill``: the last stage's rank dies inside that step, before its gradients are averaged."""

    def __init__(self, kill: list[int] | None = None) -> None:
        # SGD with momentum: its state heals too, and float rounding stays rounding (Adam's first steps turn the
        # sign of a gradient near zero, summed in another order, into a whole learning-rate step)
        super().__init__(n_layers=4, optimizer="sgd", lr=0.05)
        self.kill = kill

    def training_step(self, batch, batch_idx):
        if self.kill and ATTEMPT == 0 and [int(os.environ.get("RANK", 0)), self.global_step] == self.kill:
            os.kill(os.getpid(), signal.SIGKILL)
        return super().training_step(batch, batch_idx)

    def configure_optimizers(self):
        optimizer = super().configure_optimizers()
        decay = torch.optim.lr_scheduler.LambdaLR(optimizer, lambda step: 1.0 / (1 + 0.1 * step))
        return {"optimizer": optimizer, "lr_scheduler": {"scheduler": decay, "interval": "step"}}


def loader(cfg: dict[str, Any]):
    from torchdata.stateful_dataloader import StatefulDataLoader

    return StatefulDataLoader(Tokens(cfg["n"], seed=0), batch_size=cfg["batch"], shuffle=False)


def checksum(module: torch.nn.Module) -> int:
    crc = 0
    for name, tensor in sorted(module.state_dict().items()):
        crc = zlib.crc32(name.encode() + local_tensor(tensor).detach().cpu().contiguous().numpy().tobytes(), crc)
    return crc


class Record(Callback):
    def __init__(self, cfg: dict[str, Any]) -> None:
        self.cfg, self.rank = cfg, int(os.environ["RANK"])
        self.path = Path(cfg["out"]) / f"group{cfg['group']}_rank{self.rank}.jsonl"
        self.before: dict[str, Any] = {}

    def setup(self, trainer, pl_module, stage):  # before the group's first quorum
        (Path(self.cfg["out"]) / f"group{self.cfg['group']}_attempt{ATTEMPT}_{self.rank}").write_text("set up")
        for name in self.cfg.get("setup_waits", []) if ATTEMPT == 0 else []:
            _wait_for(Path(self.cfg["out"]) / name)

    def on_train_start(self, trainer, pl_module):  # after it
        (Path(self.cfg["out"]) / f"group{self.cfg['group']}_started{ATTEMPT}_{self.rank}").write_text("started")

    def on_train_batch_start(self, trainer, pl_module, batch, batch_idx):
        for at, name in self.cfg.get("waits", []):
            if at == batch_idx:
                _wait_for(Path(self.cfg["out"]) / name)
        for start, name in self.cfg.get("pace", []):  # from that step until the file exists: a step each half second
            if trainer.global_step >= start and not (Path(self.cfg["out"]) / name).exists():
                time.sleep(0.5)
        self.before = {"batch": batch_idx, "epoch": trainer.current_epoch, "step": trainer.global_step,
                       "tokens": batch["tokens"][:, 0].tolist()}

    def on_train_batch_end(self, trainer, pl_module, outputs, batch, batch_idx):
        replicas = trainer.strategy._replicas
        line = {**self.before, "attempt": ATTEMPT, "committed": replicas._committed, "crc": checksum(pl_module),
                "participants": replicas.manager.num_participants(), "after": trainer.global_step,
                "quorum": replicas.manager._quorum_id,
                "lr": trainer.optimizers[0].param_groups[0]["lr"], "pid": os.getpid(), "time": time.time()}  # fmt: skip
        with self.path.open("a") as f:
            f.write(json.dumps(line) + "\n")

    def on_train_end(self, trainer, pl_module):
        out = Path(self.cfg["out"]) / f"group{self.cfg['group']}_rank{self.rank}.pt"
        whole = {k: v.full_tensor() if isinstance(v, DTensor) else v for k, v in pl_module.state_dict().items()}
        torch.save({k: v.detach().clone() for k, v in whole.items()}, out)


def _wait_for(path: Path) -> None:
    deadline = time.monotonic() + 240
    while not path.exists() and time.monotonic() < deadline:
        time.sleep(0.1)


def run(cfg: dict[str, Any]) -> None:
    torch.set_num_threads(1)
    L.seed_everything(cfg.get("seed", 0), verbose=False)
    model = ScheduledGPT(cfg.get("kill"))
    ft = {"group": cfg["group"], "groups": cfg["groups"], "lighthouse": cfg["lighthouse"], "timeout": cfg["timeout"],
          "quorum_timeout": cfg["timeout"], "connect_timeout": cfg.get("connect_timeout", 10), "hostname": "127.0.0.1",
          "min_groups": cfg.get("min_groups", 1)}
    strategy = lightning_pp.PipelineStrategy(
        schedule="1f1b", n_microbatches=2, layers="net.blocks", fault_tolerance=ft, timeout=cfg["timeout"],
        data_parallel=cfg.get("data_parallel", "ddp"), pipeline_parallel_size=cfg.get("pp"),
    )  # fmt: skip
    trainer = L.Trainer(
        accelerator="cpu", devices=cfg["devices"], strategy=strategy, max_steps=cfg["steps"], logger=False,
        enable_checkpointing=False, enable_progress_bar=False, enable_model_summary=False,
        num_sanity_val_steps=0, callbacks=[Record(cfg)],
    )  # fmt: skip
    trainer.fit(model, loader(cfg))


def reference(batches: list[dict[str, torch.Tensor]]) -> dict[str, torch.Tensor]:
    """One process, the same module and optimizer, one step per given batch."""
    L.seed_everything(0, verbose=False)
    model = ScheduledGPT()
    trainer = L.Trainer(
        accelerator="cpu", devices=1, max_steps=len(batches), logger=False, enable_checkpointing=False,
        enable_progress_bar=False, enable_model_summary=False,
    )  # fmt: skip
    trainer.fit(model, torch.utils.data.DataLoader(batches, batch_size=None))
    return {k: v.detach().clone() for k, v in model.state_dict().items()}


if __name__ == "__main__":
    run(json.loads(sys.argv[1]))
