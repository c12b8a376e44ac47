"""One rank of a fine-tune of a pretrained HF Llama built on meta and read by ``init_weights``: every weight
trained (``full``) or LoRA adapters on a frozen base (``lora``). Rank 0 writes every rank's peak memory growth
(from before the model is built), its stage's parameter bytes, its step times, and the checkpoint saved at the
end: bytes on disk and the save's wall time.

    torchrun --nproc_per_node P run_lora.py ROUTE DIR STEPS OUT     (ROUTE: full | lora)
"""

from __future__ import annotations

import json
import os
import sys
import time
from pathlib import Path

import lightning as L
import torch
import torch.distributed as dist
from common import proc_kib
from lightning.pytorch.callbacks import Callback
from torch.utils.data import DataLoader

from lightning_pp import PipelineStrategy

LORA = dict(r=16, lora_alpha=32, lora_dropout=0.0, target_modules=["q_proj", "k_proj", "v_proj", "o_proj"])


class Llama(L.LightningModule):
    def __init__(self, config, lora: bool) -> None:
        super().__init__()
        from transformers import LlamaForCausalLM

        self.model = LlamaForCausalLM(config)
        if lora:
            from peft import LoraConfig, get_peft_model

            self.model = get_peft_model(self.model, LoraConfig(**LORA))

    def training_step(self, batch, batch_idx):
        return self.model(input_ids=batch, labels=batch).loss

    def configure_optimizers(self):
        return torch.optim.AdamW([p for p in self.parameters() if p.requires_grad], lr=1e-4)


class Record(Callback):
    def __init__(self) -> None:
        self.ends: list[float] = []

    def on_train_batch_end(self, trainer, *args) -> None:
        self.ends.append(time.perf_counter())

    def on_train_end(self, trainer, pl_module) -> None:
        self.hwm = proc_kib("VmHWM:") * 1024


def _bytes(path: Path) -> int:
    return path.stat().st_size if path.is_file() else sum(f.stat().st_size for f in path.rglob("*") if f.is_file())


if __name__ == "__main__":
    from transformers import AutoConfig

    route, path, steps, out = sys.argv[1], sys.argv[2], int(sys.argv[3]), sys.argv[4]
    ranks = int(os.environ["WORLD_SIZE"])
    config = AutoConfig.from_pretrained(path)
    layers = "model.base_model.model.model.layers" if route == "lora" else "model.model.layers"
    strategy = PipelineStrategy(split="trace", layers=layers, init_weights=path, state_dict_type="sharded")
    trainer = L.Trainer(accelerator="cpu", devices=ranks, strategy=strategy, max_steps=steps, logger=False,
                        enable_checkpointing=False, enable_progress_bar=False, enable_model_summary=False)  # fmt: skip
    open("/proc/self/clear_refs", "w").write("5")  # the peak from here: before the model exists
    before = proc_kib("VmRSS:") * 1024
    record = Record()
    trainer.callbacks.append(record)
    with trainer.init_module(empty_init=True):
        model = Llama(config, lora=route == "lora")
    whole = sum(p.numel() * p.element_size() for p in model.parameters())
    trainable = sum(p.numel() for p in model.parameters() if p.requires_grad)
    tokens = torch.randint(0, config.vocab_size, (16 * steps, 16), generator=torch.Generator().manual_seed(0))
    trainer.fit(model, DataLoader(tokens, batch_size=16))
    ckpt = Path(out).parent / f"{route}.ckpt"
    start = time.perf_counter()
    trainer.save_checkpoint(ckpt)
    save_s = time.perf_counter() - start
    row = {"peak_growth": record.hwm - before, "ends": record.ends,
           "stage_bytes": sum(p.numel() * p.element_size() for p in model.parameters())}  # fmt: skip
    rows: list = [None] * dist.get_world_size()
    dist.all_gather_object(rows, row)
    if dist.get_rank() == 0:
        result = {"whole_bytes": whole, "trainable": trainable, "ranks": rows, "checkpoint_bytes": _bytes(ckpt),
                  "save_s": save_s}  # fmt: skip
        with open(out, "w") as f:
            json.dump(result, f)
