"""Activation checkpointing of each pipelined layer (GPipe's re-materialisation).

Each layer keeps only its inputs for backward and recomputes its activations there. The layer's
``forward`` is wrapped on the instance, so module names, state-dict keys and hooks stay as they are
(torch's ``checkpoint_wrapper`` would insert a ``_checkpoint_wrapped_module`` level into every key).
"""

from __future__ import annotations

from collections.abc import Callable, Mapping
from typing import Any

import torch
from torch import nn
from torch.utils.checkpoint import checkpoint


def checkpoint_layers(layers: Mapping[str, nn.Module]) -> None:
    """Recompute each layer's activations in backward; random ops (dropout) replay the same draws."""
    for layer in layers.values():
        if not getattr(layer.forward, "_recomputed", False):
            layer.forward = _recomputed(layer.forward)  # type: ignore[method-assign]


def _recomputed(forward: Callable[..., Any]) -> Callable[..., Any]:
    def run(*args: Any, **kwargs: Any) -> Any:
        if not torch.is_grad_enabled():  # evaluation saves nothing anyway
            return forward(*args, **kwargs)
        return checkpoint(forward, *args, use_reentrant=False, **kwargs)

    run._recomputed = True  # type: ignore[attr-defined]
    return run
