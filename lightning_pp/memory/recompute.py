"""Activation checkpointing of each pipelined layer (GPipe's re-materialisation).

Each layer keeps only its inputs for backward and recomputes its activations there. The layer's
``forward`` is wrapped on the instance, so module names, state-dict keys and hooks stay as they are
(torch's ``checkpoint_wrapper`` would insert a ``_checkpoint_wrapped_module`` level into every key).

torch's own non-reentrant checkpoint recomputes once per autograd call and frees each recomputed
tensor as soon as backward has read it: right for one backward per micro-batch. The zero-bubble and
V schedules split each micro-batch's backward into an input pass and weight passes, so a layer
recomputed its forward once per pass (9 forward calls instead of 6 for 3 layers; ZBV's step took
2.8x with recompute against 1.4x for 1F1B). For those (``once=True``) the recomputation belongs to
the layer call: the first unpack in any pass recomputes, later ones (the weight pass reads some of
the input pass's tensors) reuse it, and the values go with the autograd graph, after the weight
pass. torch 2.13's ``GraphExecGroup`` recomputes once too, but refuses passes that read the same
saved tensor (a ReLU's result is read by both).
"""

from __future__ import annotations

import contextlib
from collections.abc import Callable, Collection, Mapping
from typing import Any

import torch
from torch import nn
from torch.utils._pytree import tree_flatten
from torch.utils.checkpoint import checkpoint


def checkpoint_layers(layers: Mapping[str, nn.Module], once: bool = False, only: Collection[str] | None = None) -> None:
    """Recompute each layer's activations in backward (or those named in ``only``); random ops (dropout) replay the
    same draws. ``once``: one recomputation shared by the passes of a split backward (the zero-bubble and V
    schedules)."""
    for name, layer in layers.items():
        if (only is None or name in only) and not getattr(layer.forward, "_recomputed", False):
            layer.forward = _recomputed(layer.forward, once)  # type: ignore[method-assign]


def marked_by_the_model(layers: Mapping[str, nn.Module]) -> frozenset[str]:
    """The layers a model's own gradient checkpointing recomputes (transformers' ``gradient_checkpointing_enable``
    marks each of its layers, or every ``every_n_layers``-th): a trace of the model records no checkpoint."""
    return frozenset(name for name, layer in layers.items() if getattr(layer, "gradient_checkpointing", False))


def _recomputed(forward: Callable[..., Any], once: bool) -> Callable[..., Any]:
    def run(*args: Any, **kwargs: Any) -> Any:
        if not torch.is_grad_enabled():  # evaluation saves nothing anyway
            return forward(*args, **kwargs)
        if not once:
            return checkpoint(forward, *args, use_reentrant=False, **kwargs)
        return _Call(forward, args, kwargs).run()

    run._recomputed = True  # type: ignore[attr-defined]
    return run


class _Call:
    """One call of a layer: what backward needs to recompute it, and the recomputed saved tensors."""

    def __init__(self, forward: Callable[..., Any], args: tuple, kwargs: dict) -> None:
        self.forward, self.args, self.kwargs = forward, args, kwargs
        tensors = [t for t in tree_flatten((args, kwargs))[0] if isinstance(t, torch.Tensor)]
        self.cuda = sorted({t.device.index or 0 for t in tensors if t.device.type == "cuda"})
        self.rng = torch.get_rng_state()
        self.cuda_rng = [torch.cuda.get_rng_state(d) for d in self.cuda]
        self.autocast = {
            device: (torch.is_autocast_enabled(device), torch.get_autocast_dtype(device))
            for device in ("cpu", "cuda")
            if device == "cpu" or self.cuda
        }
        self.saved = 0  # tensors the forward saved for backward
        self.values: list[torch.Tensor] | None = None

    def run(self) -> Any:
        def pack(_: torch.Tensor) -> tuple[_Call, int]:
            self.saved += 1
            return self, self.saved - 1

        with torch.autograd.graph.saved_tensors_hooks(pack, _unpack):
            return self.forward(*self.args, **self.kwargs)

    def recompute(self) -> list[torch.Tensor]:
        if self.values is None:
            values: list[torch.Tensor] = []

            def keep(t: torch.Tensor) -> torch.Tensor:
                # the recomputation's own graph must hold the detached value too: a node that saved its output
                # would otherwise hold a tensor whose grad_fn is that node, a cycle through C++ that Python's
                # collector cannot see, keeping the graph, the earlier layer's call and its values alive
                values.append(t.detach() if t.requires_grad else t)
                return values[-1]

            with contextlib.ExitStack() as stack:
                stack.enter_context(torch.random.fork_rng(devices=self.cuda))
                torch.set_rng_state(self.rng)
                for device, state in zip(self.cuda, self.cuda_rng):
                    torch.cuda.set_rng_state(state, device)
                for device, (enabled, dtype) in self.autocast.items():
                    stack.enter_context(torch.autocast(device, dtype=dtype, enabled=enabled))
                stack.enter_context(torch.enable_grad())
                stack.enter_context(torch.autograd.graph.saved_tensors_hooks(keep, lambda t: t))
                self.forward(*self.args, **self.kwargs)
            if len(values) != self.saved:
                raise RuntimeError(
                    f"activation_checkpointing: recomputing a layer saved {len(values)} tensors for backward, its"
                    f" forward saved {self.saved}; the layer's forward must do the same work every time it runs"
                    " (no data-dependent branches), or train with activation_checkpointing=False."
                )
            self.values = values
        return self.values


def _unpack(handle: tuple[_Call, int]) -> torch.Tensor:
    call, index = handle
    return call.recompute()[index]
