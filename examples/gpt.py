"""A small GPT following the seed convention, and data that needs no download.

The model keeps its blocks in an ``nn.ModuleDict`` and its ``forward`` skips parts that are
``None``: that is all ``PipelineStrategy`` asks of a module.
"""

from __future__ import annotations

from dataclasses import dataclass

import lightning as L
import torch
import torch.nn.functional as F
from torch import nn
from torch.utils.data import DataLoader, Dataset


@dataclass
class GPTConfig:
    vocab: int = 64
    dim: int = 64
    n_layers: int = 4
    n_heads: int = 4
    seq_len: int = 32
    lr: float = 3e-3


class Block(nn.Module):
    def __init__(self, cfg: GPTConfig) -> None:
        super().__init__()
        self.layer = nn.TransformerEncoderLayer(
            cfg.dim, cfg.n_heads, 4 * cfg.dim, dropout=0.0, batch_first=True, norm_first=True
        )
        self.register_buffer("mask", nn.Transformer.generate_square_subsequent_mask(cfg.seq_len), persistent=False)

    def forward(self, h: torch.Tensor) -> torch.Tensor:
        t = h.shape[1]
        return self.layer(h, src_mask=self.mask[:t, :t], is_causal=True)


class GPT(L.LightningModule):
    def __init__(
        self, vocab: int = 64, dim: int = 64, n_layers: int = 4, n_heads: int = 4, seq_len: int = 32, lr: float = 3e-3
    ) -> None:
        super().__init__()
        self.save_hyperparameters()
        cfg = GPTConfig(vocab, dim, n_layers, n_heads, seq_len, lr)
        self.tok_embeddings = nn.Embedding(cfg.vocab, cfg.dim)
        self.layers = nn.ModuleDict({str(i): Block(cfg) for i in range(cfg.n_layers)})
        self.norm = nn.LayerNorm(cfg.dim)
        self.output = nn.Linear(cfg.dim, cfg.vocab)

    def forward(self, tokens: torch.Tensor) -> torch.Tensor:
        h = self.tok_embeddings(tokens) if self.tok_embeddings is not None else tokens
        for layer in self.layers.values():
            h = layer(h)
        h = self.norm(h) if self.norm is not None else h
        return self.output(h) if self.output is not None else h

    def _loss(self, batch: tuple[torch.Tensor, torch.Tensor]) -> torch.Tensor:
        x, y = batch
        return F.cross_entropy(self(x).flatten(0, 1), y.flatten())

    def training_step(self, batch, batch_idx):
        loss = self._loss(batch)
        self.log("train_loss", loss, prog_bar=True)
        return loss

    def validation_step(self, batch, batch_idx):
        self.log("val_loss", self._loss(batch), prog_bar=True)

    def test_step(self, batch, batch_idx):
        self.log("test_loss", self._loss(batch))

    def configure_optimizers(self):
        return torch.optim.AdamW(self.parameters(), lr=self.hparams.lr)


class Progressions(Dataset):
    """Arithmetic progressions modulo the vocabulary: generated, no download, learnable in a minute.

    A sequence starts anywhere and steps by 1 to 4, so after two tokens the rest is predictable
    and the loss falls from ln(vocab) towards zero.
    """

    def __init__(self, n: int = 1024, seq_len: int = 32, vocab: int = 64, seed: int = 0) -> None:
        g = torch.Generator().manual_seed(seed)
        start = torch.randint(0, vocab, (n, 1), generator=g)
        step = torch.randint(1, 5, (n, 1), generator=g)
        self.data = (start + step * torch.arange(seq_len + 1)) % vocab

    def __len__(self) -> int:
        return len(self.data)

    def __getitem__(self, i: int) -> tuple[torch.Tensor, torch.Tensor]:
        row = self.data[i]
        return row[:-1], row[1:]


def loaders(batch_size: int = 16, n_train: int = 1024, n_val: int = 128, seq_len: int = 32, vocab: int = 64):
    train = DataLoader(Progressions(n_train, seq_len, vocab, seed=0), batch_size=batch_size, shuffle=True)
    val = DataLoader(Progressions(n_val, seq_len, vocab, seed=1), batch_size=batch_size)
    return train, val
