"""The models ``overhead.py`` compares on, each built the same way by the strategy run and the raw script.

A shape is a LightningModule whose ``layers`` (a ModuleDict) both sides split evenly over the ranks, and
``stage_of`` trims it to one rank's stage as PyTorch's tutorial does by hand. They differ where an
allocator or a runtime could tax them differently: weights far larger than a step's activations (the
gradients are the step's big allocations), the reverse (a step's activations are), plain
``nn.TransformerEncoderLayer``s under SGD (the model issue 32 measured), and the design card's GPT under AdamW.
"""

from __future__ import annotations

from typing import Any

import lightning as L
import torch
import torch.nn.functional as F
from common import BATCH, MODEL, batches
from torch import nn

from lightning_pp.examples.gpt import GPT


class Stack(L.LightningModule):
    """Layers one after another, a mean-squared error on the last one's output, SGD."""

    def __init__(self, layers: list[nn.Module]) -> None:
        super().__init__()
        self.layers = nn.ModuleDict({str(i): layer for i, layer in enumerate(layers)})

    def forward(self, h: torch.Tensor) -> torch.Tensor:
        for layer in self.layers.values():
            h = layer(h)
        return h

    def training_step(self, batch: tuple[torch.Tensor, torch.Tensor], batch_idx: int) -> torch.Tensor:
        return loss_of(self, self(batch[0]), batch[1])

    def configure_optimizers(self) -> torch.optim.Optimizer:
        return torch.optim.SGD(self.parameters(), lr=1e-3)


def _mlp(dim: int, n_layers: int) -> list[nn.Module]:
    return [nn.Sequential(nn.Linear(dim, dim), nn.ReLU()) for _ in range(n_layers)]


class Residual(nn.Module):
    """``h + Linear(ReLU(Linear(h)))`` with a hidden width of its own."""

    def __init__(self, dim: int, hidden: int) -> None:
        super().__init__()
        self.mlp = nn.Sequential(nn.Linear(dim, hidden), nn.ReLU(), nn.Linear(hidden, dim))

    def forward(self, h: torch.Tensor) -> torch.Tensor:
        return h + self.mlp(h)


# the uneven stack's hidden widths: two blocks cost 8x the others, both in the second half
UNEVEN_WIDTHS = (512, 512, 512, 512, 4096, 4096, 512, 512)


# name: (build, input shape of one batch); every batch is BATCH samples unless the shape says otherwise
SHAPES: dict[str, dict[str, Any]] = {
    "gpt": {"about": "the design card's GPT (8 blocks, d=256, ff 1024, vocab 1000), AdamW", "input": None},
    "encoder": {
        "about": "8 nn.TransformerEncoderLayer d=256, 4 heads, ff 2048, 64 tokens, SGD (issue 32's model)",
        "build": lambda: [nn.TransformerEncoderLayer(256, 4, dropout=0.0, batch_first=True) for _ in range(8)],
        "input": (BATCH, 64, 256),
    },
    "encoder_1024": {
        "about": "8 nn.TransformerEncoderLayer d=1024, 16 heads, ff 4096, 64 tokens, SGD (compile's GPU target)",
        "build": lambda: [nn.TransformerEncoderLayer(1024, 16, 4096, dropout=0.0, batch_first=True) for _ in range(8)],
        "input": (BATCH, 64, 1024),
        "gpu_only": True,  # 1.3 GFLOP a sample: on this project's 2-core CPUs minutes a step
    },
    "wide_mlp": {
        "about": "weights >> activations: 8 Linear 2048x2048 (16 MiB each), 16 samples, SGD",
        "build": lambda: _mlp(2048, 8),
        "input": (16, 2048),
    },
    "deep_activations": {
        "about": "activations >> weights: 8 Linear 128x128, 16384 samples (8 MiB per activation), SGD",
        "build": lambda: _mlp(128, 8),
        "input": (16384, 128),
        "steps": 30,  # a 0.12 s step: 10 steps would time under a second
    },
    "uneven": {
        "about": f"uneven layers: 8 residual MLP blocks d=256, hidden widths {list(UNEVEN_WIDTHS)}, 32 tokens, SGD",
        "build": lambda: [Residual(256, width) for width in UNEVEN_WIDTHS],
        "input": (BATCH, 32, 256),
    },
}


def build(shape: str) -> L.LightningModule:
    torch.manual_seed(0)
    return GPT(**MODEL) if shape == "gpt" else Stack(SHAPES[shape]["build"]())


def loss_of(model: L.LightningModule, out: torch.Tensor, target: torch.Tensor) -> torch.Tensor:
    if isinstance(model, GPT):
        return F.cross_entropy(out.flatten(0, 1), target.flatten())
    return F.mse_loss(out, target)


def data(shape: str, n: int) -> list[tuple[torch.Tensor, torch.Tensor]]:
    if shape == "gpt":
        return batches(n)
    g = torch.Generator().manual_seed(0)
    size = SHAPES[shape]["input"]
    return [(torch.randn(size, generator=g), torch.randn(size, generator=g)) for _ in range(n)]


def stage_of(model: L.LightningModule, rank: int, world: int) -> L.LightningModule:
    """Keep this rank's even share of the layers (and the GPT's embedding on the first, head on the last)."""
    per_stage = len(model.layers) // world
    for key in list(model.layers.keys()):
        if int(key) // per_stage != rank:
            del model.layers[key]
    if isinstance(model, GPT):
        if rank != 0:
            model.tok_embeddings = None
        if rank != world - 1:
            model.norm, model.output = None, None
    return model
