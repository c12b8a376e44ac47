"""One rank of a Qwen3-MoE-style model (or its dense twin) built on meta, trained on 2 stages x 2 replicas with
AdamW: with its experts whole on every replica rank (``ep=1``) or split over the 2 replicas (``ep=2``). Rank 0
writes every rank's peak memory growth (from before the model is built), the experts' and the stage's bytes it
holds, and its step times.

    torchrun --nproc_per_node 4 run_moe.py MODEL EP STEPS CONFIG_JSON OUT     (MODEL: moe | dense)
"""

from __future__ import annotations

import json
import sys

import lightning as L
import torch
import torch.distributed as dist
from common import proc_kib
from run_lora import Record
from torch.utils.data import DataLoader

from lightning_pp import PipelineStrategy
from lightning_pp.layout.dtensors import local_tensor

BATCH, SEQ, M = 8, 64, 4


class LM(L.LightningModule):
    def __init__(self, config) -> None:
        super().__init__()
        from transformers import AutoModelForCausalLM

        self.model = AutoModelForCausalLM.from_config(config)

    def training_step(self, batch, batch_idx):
        return self.model(input_ids=batch, labels=batch).loss

    def configure_optimizers(self):
        return torch.optim.AdamW(self.parameters(), lr=1e-4)


if __name__ == "__main__":
    from transformers import AutoConfig

    kind, ep, steps, config, out = sys.argv[1], int(sys.argv[2]), int(sys.argv[3]), json.loads(sys.argv[4]), sys.argv[5]
    config = AutoConfig.for_model(**config)
    strategy = PipelineStrategy(split="trace", layers="model.model.layers", pipeline_parallel_size=2, n_microbatches=M,
                                expert_parallel_size=ep)  # fmt: skip
    trainer = L.Trainer(accelerator="cpu", devices=4, strategy=strategy, max_steps=steps, logger=False,
                        enable_checkpointing=False, enable_progress_bar=False, enable_model_summary=False)  # fmt: skip
    open("/proc/self/clear_refs", "w").write("5")  # the peak from here: before the model exists
    before = proc_kib("VmRSS:") * 1024
    record = Record()
    trainer.callbacks.append(record)
    with trainer.init_module(empty_init=True):
        model = LM(config)
    whole = sum(p.numel() * p.element_size() for p in model.parameters())
    experts_whole = sum(p.numel() * p.element_size() for n, p in model.named_parameters() if ".experts." in n)
    tokens = torch.randint(0, config.vocab_size, (2 * BATCH * steps, SEQ), generator=torch.Generator().manual_seed(0))
    trainer.fit(model, DataLoader(tokens, batch_size=BATCH))
    held = [(n, local_tensor(p)) for n, p in model.named_parameters()]
    row = {"peak_growth": record.hwm - before, "ends": record.ends,
           "stage_bytes": sum(t.numel() * t.element_size() for _, t in held),
           "expert_bytes": sum(t.numel() * t.element_size() for n, t in held if ".experts." in n)}  # fmt: skip
    rows: list = [None] * dist.get_world_size()
    dist.all_gather_object(rows, row)
    if dist.get_rank() == 0:
        with open(out, "w") as f:
            json.dump({"whole_bytes": whole, "experts_whole_bytes": experts_whole, "ranks": rows}, f)
