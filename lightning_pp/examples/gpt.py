"""A small GPT following the seed convention.

The model keeps its blocks in an ``nn.ModuleDict`` and its ``forward`` skips parts that are
``None``: that is all ``PipelineStrategy`` asks of a module. Its ``configure_model`` splits each
block's MLP over the tensor-parallel ranks when the strategy has some
(``PipelineStrategy(tensor_parallel_size=2)``, or Lightning's ``ModelParallelStrategy``).
"""

from __future__ import annotations

import lightning as L
import torch
import torch.nn.functional as F
from torch import nn
from torch.distributed.tensor import DTensor
from torch.distributed.tensor.parallel import ColwiseParallel, RowwiseParallel, parallelize_module


class Block(nn.Module):
    """A pre-norm causal transformer block."""

    def __init__(self, dim: int, n_heads: int, seq_len: int) -> None:
        super().__init__()
        self.layer = nn.TransformerEncoderLayer(dim, n_heads, 4 * dim, dropout=0.0, batch_first=True, norm_first=True)
        self.register_buffer("mask", nn.Transformer.generate_square_subsequent_mask(seq_len), persistent=False)

    def forward(self, h: torch.Tensor) -> torch.Tensor:
        t = h.shape[1]
        return self.layer(h, src_mask=self.mask[:t, :t], is_causal=True)


class GPT(L.LightningModule):
    def __init__(
        self, vocab: int = 64, dim: int = 64, n_layers: int = 4, n_heads: int = 4, seq_len: int = 32, lr: float = 3e-3
    ) -> None:
        super().__init__()
        self.save_hyperparameters()
        self.tok_embeddings = nn.Embedding(vocab, dim)
        self.layers = nn.ModuleDict({str(i): Block(dim, n_heads, seq_len) for i in range(n_layers)})
        self.norm = nn.LayerNorm(dim)
        self.output = nn.Linear(dim, vocab)

    def configure_model(self) -> None:
        """Megatron's MLP split: the first linear column-wise, the second row-wise (one all-reduce per block)."""
        mesh = self.device_mesh
        if mesh is None or "tensor_parallel" not in (mesh.mesh_dim_names or ()) or mesh["tensor_parallel"].size() == 1:
            return
        plan = {"linear1": ColwiseParallel(), "linear2": RowwiseParallel()}
        for block in self.layers.values():
            if block is not None and not isinstance(block.layer.linear1.weight, DTensor):  # runs again for validate
                parallelize_module(block.layer, mesh["tensor_parallel"], plan)

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
