"""One rank of a pretrained load: ``init_weights`` on a meta build, or ``from_pretrained`` on every rank; rank 0
writes every rank's peak memory growth (counted from before the model is built) over the whole run and up to
the end of the load (``init_weights``: the strategy's read at the first batch; ``from_pretrained``: the
module's constructor), its stage's parameter bytes and names, and the time to the end of the first step.

    torchrun --nproc_per_node P run_pretrained.py ROUTE DIR OUT     (ROUTE: init_weights | from_pretrained)
"""

from __future__ import annotations

import json
import os
import sys
import time

import lightning as L
import torch
import torch.distributed as dist
from common import proc_kib
from lightning.pytorch.callbacks import Callback
from torch.utils.data import DataLoader

import lightning_pp.holding.stages
from lightning_pp import PipelineStrategy


class Llama(L.LightningModule):
    def __init__(self, config=None, path=None) -> None:
        super().__init__()
        from transformers import AutoModelForCausalLM, LlamaForCausalLM

        self.model = LlamaForCausalLM(config) if path is None else AutoModelForCausalLM.from_pretrained(path).train()

    def training_step(self, batch, batch_idx):
        return self.model(input_ids=batch, labels=batch).loss

    def configure_optimizers(self):
        return torch.optim.SGD(self.parameters(), lr=1e-3)


class FirstStep(Callback):
    def __init__(self, start: float) -> None:
        self.start = start
        self.first: dict = {}

    def on_train_batch_end(self, trainer, *args) -> None:
        if not self.first:
            self.first = {"first_step_s": time.perf_counter() - self.start}

    def on_train_end(self, trainer, pl_module) -> None:
        self.hwm = proc_kib("VmHWM:") * 1024


def growth_at_end_of(function, record: dict, before: int):
    """``function``, recording the peak growth up to its return: the load inside the strategy's first batch."""

    def run(*args, **kwargs):
        out = function(*args, **kwargs)
        record["load_peak_growth"] = proc_kib("VmHWM:") * 1024 - before
        return out

    return run


if __name__ == "__main__":
    from transformers import AutoConfig

    route, path, out = sys.argv[1:4]
    ranks = int(os.environ["WORLD_SIZE"])
    config = AutoConfig.from_pretrained(path)
    tiny = Llama(config.__class__(**{**config.to_dict(), "num_hidden_layers": 1, "hidden_size": 64,
                                     "intermediate_size": 64, "vocab_size": 64, "num_attention_heads": 4,
                                     "num_key_value_heads": 2}))  # fmt: skip
    tiny.training_step(torch.zeros(2, 8, dtype=torch.long), 0).backward()  # torch's kernels paged in
    strategy = PipelineStrategy(split="trace", layers="model.model.layers",
                                init_weights=path if route == "init_weights" else None)  # fmt: skip
    trainer = L.Trainer(accelerator="cpu", devices=ranks, strategy=strategy, max_steps=2, logger=False,
                        enable_checkpointing=False, enable_progress_bar=False, enable_model_summary=False)  # fmt: skip
    open("/proc/self/clear_refs", "w").write("5")  # the peak from here: before the model exists
    before, start = proc_kib("VmRSS:") * 1024, time.perf_counter()
    first = FirstStep(start)
    trainer.callbacks.append(first)
    record: dict = {}
    if route == "init_weights":
        with trainer.init_module(empty_init=True):
            model = Llama(config)
        holding = lightning_pp.holding.stages
        holding.load_weights = growth_at_end_of(holding.load_weights, record, before)
    else:
        model = Llama(path=path)
        record["load_peak_growth"] = proc_kib("VmHWM:") * 1024 - before
    whole = sum(p.numel() * p.element_size() for p in model.parameters())
    tokens = torch.randint(0, config.vocab_size, (64, 16), generator=torch.Generator().manual_seed(0))
    trainer.fit(model, DataLoader(tokens, batch_size=16))
    row = {**first.first, **record, "peak_growth": first.hwm - before, "names": list(model.state_dict()),
           "stage_bytes": sum(p.numel() * p.element_size() for p in model.parameters())}  # fmt: skip
    rows: list = [None] * dist.get_world_size()
    dist.all_gather_object(rows, row)
    if dist.get_rank() == 0:
        with open(out, "w") as f:
            json.dump({"whole_bytes": whole, "ranks": rows}, f)
