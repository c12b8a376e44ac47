"""Shared pieces of the benchmarks: the model and data of the design card, machine info, medians."""

from __future__ import annotations

import os
import platform
import statistics
from typing import Any

import torch

# the model of the design card: 8 TransformerEncoderLayers, d=256, 4 heads, ff 1024, vocab 1000, 64 tokens
MODEL = dict(vocab=1000, dim=256, n_layers=8, n_heads=4, seq_len=64)
BATCH = 32


def batches(n: int, seed: int = 0) -> list[tuple[torch.Tensor, torch.Tensor]]:
    g = torch.Generator().manual_seed(seed)
    data = torch.randint(0, MODEL["vocab"], (n, BATCH, MODEL["seq_len"] + 1), generator=g)
    return [(d[:, :-1], d[:, 1:]) for d in data]


def pipeline_trainer(schedule: str, m: int, steps: int, callback: Any) -> Any:
    """The Trainer every strategy benchmark uses: torchrun's ranks, nothing but training and ``callback``."""
    import lightning as L

    from lightning_pp import PipelineStrategy

    return L.Trainer(
        accelerator="cpu",
        devices=int(os.environ.get("LOCAL_WORLD_SIZE", 2)),
        strategy=PipelineStrategy(schedule=schedule, n_microbatches=m),
        max_steps=steps,
        logger=False,
        enable_checkpointing=False,
        enable_progress_bar=False,
        enable_model_summary=False,
        num_sanity_val_steps=0,
        callbacks=[callback],
    )


def machine() -> dict[str, Any]:
    return {
        "python": platform.python_version(),
        "torch": torch.__version__,
        "cpus": os.cpu_count(),
        "processor": platform.processor() or platform.machine(),
    }


def median_spread(values: list[float]) -> dict[str, float]:
    return {"median": statistics.median(values), "min": min(values), "max": max(values), "n": len(values)}
