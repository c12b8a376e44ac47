"""A residual MLP classifier for the digits data, in the seed convention."""

from __future__ import annotations

import lightning as L
import torch
import torch.nn.functional as F
from torch import nn


class ResidualBlock(nn.Module):
    def __init__(self, dim: int) -> None:
        super().__init__()
        self.norm = nn.LayerNorm(dim)
        self.ff = nn.Sequential(nn.Linear(dim, 2 * dim), nn.GELU(), nn.Linear(2 * dim, dim))

    def forward(self, h: torch.Tensor) -> torch.Tensor:
        return h + self.ff(self.norm(h))


class DigitsClassifier(L.LightningModule):
    def __init__(self, n_features: int = 64, dim: int = 64, n_layers: int = 4, n_classes: int = 10, lr: float = 3e-3):
        super().__init__()
        self.save_hyperparameters()
        self.inp = nn.Linear(n_features, dim)
        self.layers = nn.ModuleDict({str(i): ResidualBlock(dim) for i in range(n_layers)})
        self.head = nn.Linear(dim, n_classes)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        h = self.inp(x) if self.inp is not None else x
        for layer in self.layers.values():
            h = layer(h)
        return self.head(h) if self.head is not None else h

    def _step(self, batch: tuple[torch.Tensor, torch.Tensor], stage: str) -> torch.Tensor:
        x, y = batch
        logits = self(x)
        loss = F.cross_entropy(logits, y)
        self.log(f"{stage}_loss", loss, prog_bar=True)
        self.log(f"{stage}_acc", (logits.argmax(-1) == y).float().mean(), prog_bar=stage == "val")
        return loss

    def training_step(self, batch, batch_idx):
        return self._step(batch, "train")

    def validation_step(self, batch, batch_idx):
        self._step(batch, "val")

    def configure_optimizers(self):
        return torch.optim.AdamW(self.parameters(), lr=self.hparams.lr)
