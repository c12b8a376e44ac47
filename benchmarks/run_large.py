"""One rank of a large-model run: build eagerly or on meta, train a few SGD steps, optionally resume from and
write a sharded checkpoint; rank 0 writes every rank's peak memory growth (counted from before the model
is built) and its stage's parameter bytes.

    torchrun --nproc_per_node P run_large.py BUILD RESUME SAVE OUT [STEPS]

BUILD: eager or meta; RESUME, SAVE: a path or -.
"""

from __future__ import annotations

import json
import sys

import torch
import torch.distributed as dist
from common import LARGE, pipeline_trainer, proc_kib
from lightning.pytorch.callbacks import Callback
from torch.utils.data import DataLoader

from lightning_pp.examples.gpt import GPT


class SGDGPT(GPT):
    def configure_optimizers(self):
        return torch.optim.SGD(self.parameters(), lr=1e-3)


def _page_in_kernels(model_cfg: dict) -> None:
    """One step of a tiny copy of the model, so that the code of torch's kernels (15 MiB of libtorch_cpu.so
    pages, shared by every process on the machine, first touched by the first backward) is resident before
    the peak is counted: the peak is then the rank's memory, not the library's."""
    tiny = SGDGPT(**{**model_cfg, "dim": 64, "n_layers": 2, "n_heads": 4})
    tokens = torch.zeros(2, model_cfg["seq_len"], dtype=torch.long)
    tiny.training_step((tokens, tokens), 0).backward()
    tiny.configure_optimizers().step()


class Peak(Callback):
    def on_train_end(self, trainer, pl_module) -> None:
        self.hwm = proc_kib("VmHWM:") * 1024


if __name__ == "__main__":
    build, resume, save, out = sys.argv[1:5]
    ranks = int(__import__("os").environ["WORLD_SIZE"])
    peak = Peak()
    steps = (int(sys.argv[5]) if len(sys.argv) > 5 else LARGE["steps"]) * (
        1 if resume == "-" else 2
    )  # a resumed run trains as many steps again
    trainer = pipeline_trainer("1f1b", ranks, steps, [peak], state_dict_type="sharded")
    model_cfg = {k: LARGE[k] for k in ("vocab", "dim", "n_layers", "n_heads", "seq_len")}
    _page_in_kernels(model_cfg)
    open("/proc/self/clear_refs", "w").write("5")  # the peak from here: before the model exists
    before = proc_kib("VmRSS:") * 1024
    if build == "meta":
        with trainer.init_module(empty_init=True):
            model = SGDGPT(**model_cfg)
    else:
        model = SGDGPT(**model_cfg)
    whole = sum(p.numel() * p.element_size() for p in model.parameters())
    g = torch.Generator().manual_seed(0)
    data = torch.randint(0, LARGE["vocab"], (steps * 4 * ranks, LARGE["seq_len"] + 1), generator=g)
    loader = DataLoader(list(zip(data[:, :-1], data[:, 1:])), batch_size=4 * ranks)
    trainer.fit(model, loader, ckpt_path=None if resume == "-" else resume)
    row = {"peak_growth": peak.hwm - before, "stage_param_bytes": sum(p.numel() * 4 for p in model.parameters())}
    if save != "-":
        trainer.save_checkpoint(save)
    rows: list = [None] * dist.get_world_size()
    dist.all_gather_object(rows, row)
    if dist.get_rank() == 0:
        with open(out, "w") as f:
            json.dump({"whole_bytes": whole, "ranks": rows}, f)
