"""Data that needs no download: generated token sequences, and scikit-learn's bundled digits."""

from __future__ import annotations

import lightning as L
import torch
from torch.utils.data import DataLoader, Dataset, TensorDataset


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


class ProgressionsData(L.LightningDataModule):
    def __init__(
        self, batch_size: int = 16, n_train: int = 1024, n_val: int = 128, seq_len: int = 32, vocab: int = 64
    ) -> None:
        super().__init__()
        self.batch_size, self.n_train, self.n_val, self.seq_len, self.vocab = batch_size, n_train, n_val, seq_len, vocab

    def train_dataloader(self) -> DataLoader:
        data = Progressions(self.n_train, self.seq_len, self.vocab, seed=0)
        return DataLoader(data, batch_size=self.batch_size, shuffle=True)

    def val_dataloader(self) -> DataLoader:
        return DataLoader(Progressions(self.n_val, self.seq_len, self.vocab, seed=1), batch_size=self.batch_size)


class DigitsData(L.LightningDataModule):
    """scikit-learn's 8x8 digits (1797 images, shipped inside the package): a real data set, no download."""

    def __init__(self, batch_size: int = 32, val_fraction: float = 0.2, seed: int = 0) -> None:
        super().__init__()
        self.batch_size, self.val_fraction, self.seed = batch_size, val_fraction, seed

    def setup(self, stage: str) -> None:
        from sklearn.datasets import load_digits

        digits = load_digits()
        x = torch.tensor(digits.data, dtype=torch.float32) / 16.0
        y = torch.tensor(digits.target, dtype=torch.long)
        order = torch.randperm(len(x), generator=torch.Generator().manual_seed(self.seed))
        n_val = int(len(x) * self.val_fraction)
        self.val, self.train = (TensorDataset(x[idx], y[idx]) for idx in (order[:n_val], order[n_val:]))

    def train_dataloader(self) -> DataLoader:
        # drop_last: every batch must split into equal micro-batches
        return DataLoader(self.train, batch_size=self.batch_size, shuffle=True, drop_last=True)

    def val_dataloader(self) -> DataLoader:
        return DataLoader(self.val, batch_size=self.batch_size, drop_last=True)
