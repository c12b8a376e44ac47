"""``microbatch_weight``: the loss one process computes when micro-batches weigh differently.

A padded batch's token-mean loss is the mean of its micro-batches' means only when every micro-batch
holds as many real tokens. Given ``fn(micro_batch) -> weight`` (for a causal LM, its label tokens that
are not -100 after the shift), the pipeline's loss and gradient become sum(w_i x loss_i) / sum(w_i)
over the micro-batches of every replica and of the whole accumulation window, as Hugging Face's
``num_items_in_batch`` normalises; logged means combine by the same weights.

The window's total is known only at its end, so each micro-batch's loss is scaled by
w_i x replicas / W_first (W_first: the window's first batch's weight over all replicas, which keeps the
scaled losses of the order of a mean, as fp16 needs); the replicas' gradient average then leaves
sum(w_i x grad_i) / W_first, and the window's last backward multiplies by W_first / W_window.
"""

from __future__ import annotations

import math
from collections.abc import Iterable
from typing import Any

import torch
import torch.distributed as dist

from lightning_pp.errors import PipelineConfigError
from lightning_pp.layout.dtensors import local_tensor
from lightning_pp.layout.options import MicrobatchWeight


def weights_of(fn: MicrobatchWeight, microbatches: list[Any]) -> list[float]:
    """``fn`` of each micro-batch, checked: finite and not negative (the same on every rank of a pipeline)."""
    weights = []
    for i, microbatch in enumerate(microbatches):
        value = fn(microbatch)
        weight = float(value.item() if isinstance(value, torch.Tensor) else value)
        if not math.isfinite(weight) or weight < 0:
            raise PipelineConfigError(
                f"microbatch_weight returned {value!r} for micro-batch {i}; it must return a finite number >= 0"
                " (for a causal LM, the count of label tokens that are not -100 after the shift)."
            )
        weights.append(weight)
    return weights


class WindowWeights:
    """The weights of the current accumulation window, over all replicas."""

    def __init__(self) -> None:
        self._first = 1.0
        self._window = 0.0

    def loss_scales(
        self, weights: list[float], starts_window: bool, group: dist.ProcessGroup | None, replicas: int
    ) -> list[float]:
        """What each micro-batch's loss is multiplied by (see the module's docstring); a collective over ``group``
        (the replicas of this stage) when there are replicas."""
        total = torch.tensor(sum(weights), dtype=torch.float64)
        if replicas > 1:
            device = "cuda" if dist.get_backend(group) == "nccl" else "cpu"
            total = total.to(device)
            dist.all_reduce(total, group=group)
        total_weight = float(total)
        if starts_window:
            self._first, self._window = (total_weight or 1.0), 0.0
        self._window += total_weight
        return [w * replicas / self._first for w in weights]

    def end_window(self, parameters: Iterable[torch.nn.Parameter]) -> None:
        """After the window's last backward: the gradients become the weighted mean over the whole window."""
        if self._window == 0:  # every micro-batch weighed 0: nothing was learned, nothing to rescale
            return
        factor = self._first / self._window
        for p in parameters:
            if p.grad is not None:
                local_tensor(p.grad).mul_(factor)


def label_tokens(micro_batch: Any, key: str | int = "labels", ignore_index: int = -100, shift: bool = True) -> int:
    """A causal LM micro-batch's weight: its label tokens that count in the loss (not ``ignore_index``), after the
    shift by one that Hugging Face's causal LMs apply to ``labels``. ``key`` names the labels in a dict batch (or
    indexes a tuple batch); ``functools.partial(label_tokens, key=...)`` or Hydra's ``_partial_: true`` sets it."""
    labels = micro_batch[key]
    if shift:
        labels = labels[..., 1:]
    return int((labels != ignore_index).sum())
