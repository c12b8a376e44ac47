"""One rank of a Hugging Face model from a config (no download) trained through ``split="trace"`` on 2 stages
(1F1B, AdamW, built on meta: `run_moe`'s module and batch); rank 0 writes its step end times.

    torchrun --nproc_per_node 2 run_traced.py CONFIG_JSON STEPS OUT
"""

from __future__ import annotations

import json
import sys

import torch
from common import pipeline_trainer
from run_lora import Record
from run_moe import BATCH, LM, SEQ, M
from torch.utils.data import DataLoader

if __name__ == "__main__":
    from transformers import AutoConfig

    config, steps, out = AutoConfig.for_model(**json.loads(sys.argv[1])), int(sys.argv[2]), sys.argv[3]
    record = Record()
    trainer = pipeline_trainer("1f1b", M, steps, [record], split="trace")
    with trainer.init_module(empty_init=True):
        model = LM(config)
    tokens = torch.randint(0, config.vocab_size, (BATCH * steps, SEQ), generator=torch.Generator().manual_seed(0))
    trainer.fit(model, DataLoader(tokens, batch_size=BATCH))
    if trainer.global_rank == 0:
        with open(out, "w") as f:
            json.dump({"ends": record.ends}, f)
