"""One short pipelined training run that must exit 0 on every rank (launch with torchrun).

run_exit.py SCHEDULE
"""

from __future__ import annotations

import os
import sys

import lightning as L
import torch
from torch.utils.data import DataLoader, TensorDataset

from lightning_pp import PipelineStrategy
from lightning_pp.examples.gpt import GPT

if __name__ == "__main__":
    L.seed_everything(0, verbose=False)
    tokens = torch.randint(0, 32, (64, 9))
    loader = DataLoader(TensorDataset(tokens[:, :-1], tokens[:, 1:]), batch_size=8)
    trainer = L.Trainer(
        accelerator="cpu",
        devices=int(os.environ.get("LOCAL_WORLD_SIZE", 2)),
        strategy=PipelineStrategy(schedule=sys.argv[1], n_microbatches=4),
        max_steps=4,
        gradient_clip_val=1.0,
        logger=False,
        enable_checkpointing=False,
        enable_progress_bar=False,
        enable_model_summary=False,
        num_sanity_val_steps=0,
    )
    trainer.fit(GPT(vocab=32, dim=32, n_layers=4, n_heads=4, seq_len=8), loader)
