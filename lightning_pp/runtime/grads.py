"""A training step's gradients, kept beside the ones Lightning manages.

The schedule runs backward inside ``training_step``, but Lightning zeroes gradients between
``training_step`` and ``backward`` (``optimizer.zero_grad`` at a window's start) and only then expects
new ones: the step's gradients are held aside and added in ``backward``. At a window's first batch the
earlier gradients are released before the step rather than kept beside this step's (Lightning would zero
them anyway; ``on_before_zero_grad`` then sees none), which keeps the peak at one set of gradients.
"""

from __future__ import annotations

import contextlib
from collections.abc import Iterator

import torch
from torch import nn

StepGradients = list[tuple[nn.Parameter, torch.Tensor | None]]


def window_starts(args: tuple, accumulate: int) -> bool:
    """Whether this training step (``args`` = batch, batch_idx, ...) opens an accumulation window."""
    return len(args) > 1 and isinstance(args[1], int) and args[1] % accumulate == 0


@contextlib.contextmanager
def step_gradients(params: list[nn.Parameter], release: bool) -> Iterator[StepGradients]:
    """Parameters without gradients during the step; afterwards the earlier ones are back (None if ``release``)
    and the yielded list holds the step's."""
    earlier = [None if release else p.grad for p in params]
    for p in params:
        p.grad = None
    held: StepGradients = []
    try:
        yield held
        held.extend((p, p.grad) for p in params)
    finally:
        for p, grad in zip(params, earlier):
            p.grad = grad


def add_gradients(held: StepGradients) -> None:
    for p, grad in held:
        if grad is not None:
            p.grad = grad if p.grad is None else p.grad + grad
