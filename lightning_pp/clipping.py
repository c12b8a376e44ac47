"""Gradient clipping by the norm of the whole model, not of one stage.

Lightning clips through the precision plugin's ``clip_grad_by_norm``, which sees only this rank's
parameters: each stage would clip by its own norm (silently wrong). FSDP and DeepSpeed override
that method in their own plugin classes; a pipeline accepts any precision, so it derives the same
override from whichever plugin class the Trainer chose.
"""

from __future__ import annotations

import torch
import torch.distributed as dist
from lightning.pytorch.plugins.precision import Precision
from torch.nn.utils import clip_grads_with_norm_, get_total_norm


def global_grad_norm(parameters: list[torch.nn.Parameter], group: dist.ProcessGroup | None) -> torch.Tensor:
    """The 2-norm of the gradients of every stage's parameters (a collective over ``group``)."""
    grads = [p.grad for p in parameters if p.grad is not None]
    device = grads[0].device if grads else torch.device("cpu")
    local = get_total_norm(grads, 2.0) if grads else torch.zeros((), device=device)
    squared = local.float().pow(2).reshape(1)
    if dist.is_initialized():
        dist.all_reduce(squared, group=group)
    return squared.sqrt()[0]


class _ClipByGlobalNorm:
    _pipeline_group: dist.ProcessGroup | None

    def clip_grad_by_norm(self, optimizer: torch.optim.Optimizer, clip_val: float) -> None:
        parameters = list(self.main_params(optimizer))  # type: ignore[attr-defined]
        total = global_grad_norm(parameters, self._pipeline_group)
        clip_grads_with_norm_(parameters, clip_val, total)


_DERIVED: dict[type, type] = {}


def clip_by_global_norm(plugin: Precision, group: dist.ProcessGroup | None) -> Precision:
    """Make ``plugin`` clip by the norm over ``group``, keeping its class (and isinstance checks)."""
    cls = type(plugin)
    if not issubclass(cls, _ClipByGlobalNorm):
        derived = _DERIVED.get(cls)
        if derived is None:
            derived = _DERIVED[cls] = type(f"Pipeline{cls.__name__}", (_ClipByGlobalNorm, cls), {})
        plugin.__class__ = derived
    plugin._pipeline_group = group  # type: ignore[attr-defined]
    return plugin
