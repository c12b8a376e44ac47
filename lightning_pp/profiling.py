"""Measured cost of each layer, for ``balance="profile"``.

Parameter counts miss what dominates a step: a vocabulary head is cheap in parameters next to its
logits and loss, attention grows with the sequence. So at the first batch every rank runs one real
micro-batch forward and backward through its whole (not yet split) module, timestamps each layer
with hooks, and the ranks average their timings so that all of them choose the same split.

A module that must not be run whole (built on meta, or whose stages are meant for an accelerator)
is costed in FLOPs instead: the same forward and backward on meta tensors, the same hooks, with a
FLOP counter as the clock. That needs no weights, no real inputs and no memory, and it is identical
on every rank; it misses memory-bound work (norms, softmax), which timing one layer at a time would
see, but timing needs each layer's real weights and inputs in turn.
"""

from __future__ import annotations

import contextlib
import statistics
import time
from collections.abc import Callable, Iterator, Mapping
from typing import Any

import torch
import torch.distributed as dist
from torch import nn
from torch.utils._pytree import tree_flatten, tree_map
from torch.utils.flop_counter import FlopCounterMode

from lightning_pp.partition import Costs


def sum_of_outputs(output: Any) -> torch.Tensor:
    """A scalar whose backward reaches every differentiable tensor of ``output``."""
    tensors = [t for t in tree_flatten(output)[0] if isinstance(t, torch.Tensor) and t.requires_grad]
    if not tensors:
        return torch.zeros(())
    return sum(t.float().sum() for t in tensors)  # type: ignore[return-value]


def profile_costs(
    module: nn.Module,
    layers: Mapping[str, nn.Module],
    forward: Callable[..., Any],
    args: tuple,
    kwargs: dict,
    repeats: int = 3,
) -> Costs:
    """Seconds of forward plus backward per layer, and of the parts before and after the layers.

    One warm-up, then the median of ``repeats`` runs. The loss is the sum of the outputs (the user's
    own loss would run their step, with its logging and metric updates). Parts between layers count
    with the layer before them; the first layer's backward also holds the embedding's, which does not
    matter: both always sit on the first stage. Leaves the module as it found it (gradients,
    buffers such as running statistics, the random state).
    """
    device = next(module.parameters()).device
    sync = torch.cuda.synchronize if device.type == "cuda" else (lambda: None)

    def now() -> float:
        sync()
        return time.perf_counter()

    with _untouched(module, device):
        # validation may come first: its batch is an inference tensor, which autograd cannot save
        args, kwargs = tree_map(lambda x: x.clone() if isinstance(x, torch.Tensor) else x, (args, kwargs))
        runs = [_timed_run(layers, lambda: forward(*args, **kwargs), now) for _ in range(repeats + 1)]
    measured = runs[1:]
    return Costs(
        [statistics.median(r.layers[i] for r in measured) for i in range(len(layers))],
        statistics.median(r.first for r in measured),
        statistics.median(r.last for r in measured),
    )


def count_flops(
    module: nn.Module, layers: Mapping[str, nn.Module], forward: Callable[..., Any], args: tuple, kwargs: dict
) -> Costs:
    """FLOPs of forward plus backward per layer and of the parts before and after them, for a module
    (and inputs) on the meta device."""
    with _untouched(module, torch.device("meta")):
        return flops_of(layers, lambda: forward(*args, **kwargs))


def flops_of(layers: Mapping[str, nn.Module], run_forward: Callable[[], Any]) -> Costs:
    """FLOPs of ``run_forward`` and its backward (on meta tensors) per layer and before and after them."""
    with FlopCounterMode(display=False) as counter, torch.enable_grad():
        return _timed_run(layers, run_forward, lambda: float(counter.get_total_flops()))


@contextlib.contextmanager
def _untouched(module: nn.Module, device: torch.device) -> Iterator[None]:
    """Gradients, buffers (running statistics) and the random state as they were before the block."""
    grads = {p: p.grad for p in module.parameters()}
    buffers = {b: b.detach().clone() for b in module.buffers()}
    devices = [device.index or 0] if device.type == "cuda" else []
    try:
        with torch.random.fork_rng(devices=devices), torch.inference_mode(False), torch.enable_grad():
            yield
    finally:
        for p, g in grads.items():
            p.grad = g
        with torch.no_grad():
            for b, saved in buffers.items():
                b.copy_(saved)


def _timed_run(layers: Mapping[str, nn.Module], run_forward: Callable[[], Any], now: Callable[[], float]) -> Costs:
    """Costs of one forward and backward, read off the clock ``now`` (seconds, or FLOPs counted so far)."""
    n = len(layers)
    starts, ends = [0.0] * n, [0.0] * n
    grad_at: list[float | None] = [None] * n  # when backward reached each layer's output

    def on_start(i: int) -> Callable[..., None]:
        def hook(*_: Any) -> None:
            starts[i] = now()

        return hook

    def on_end(i: int) -> Callable[..., None]:
        def reached(grad: torch.Tensor) -> None:
            if grad_at[i] is None:
                grad_at[i] = now()

        def hook(_module: nn.Module, _inputs: Any, output: Any) -> None:
            ends[i] = now()
            for t in tree_flatten(output)[0]:
                if isinstance(t, torch.Tensor) and t.requires_grad:
                    t.register_hook(reached)

        return hook

    handles = []
    for i, layer in enumerate(layers.values()):
        handles += [layer.register_forward_pre_hook(on_start(i)), layer.register_forward_hook(on_end(i))]
    try:
        t0 = now()
        loss = sum_of_outputs(run_forward())
        t1 = now()
        loss.backward()
        t2 = now()
    finally:
        for h in handles:
            h.remove()
    # a layer whose output got no gradient (frozen) costs no backward: take its successor's time
    reached: list[float] = [0.0] * n
    later = t1
    for i in reversed(range(n)):
        later = reached[i] = grad_at[i] if grad_at[i] is not None else later
    forward = [starts[i + 1] - starts[i] for i in range(n - 1)] + [ends[-1] - starts[-1]]
    backward = [t2 - reached[0]] + [reached[i - 1] - reached[i] for i in range(1, n)]
    return Costs(
        [f + b for f, b in zip(forward, backward)],
        first=starts[0] - t0,
        last=(t1 - ends[-1]) + (reached[-1] - t1),
    )


def agree(costs: Costs, device: torch.device) -> Costs:
    """The mean of every rank's costs, so that all ranks choose the same split."""
    flat = torch.tensor([*costs.layers, costs.first, costs.last], dtype=torch.float64, device=device)
    dist.all_reduce(flat)
    values = (flat / dist.get_world_size()).tolist()
    return Costs(values[:-2], values[-2], values[-1])


def describe_costs(costs: Costs, counts: list[int], flops: bool = False) -> str:
    """The costs and the split they chose, for rank 0's log."""
    scale, unit = (1e-9, "GFLOP, counted on meta") if flops else (1e3, "ms")
    layers = ", ".join(f"{scale * c:.3g}" for c in costs.layers)
    stages = ", ".join(f"{scale * c:.3g}" for c in costs.of_stages(counts))
    return (
        f"Profiled forward+backward per micro-batch ({unit}): before the layers {scale * costs.first:.3g},"
        f" layers [{layers}], after the layers {scale * costs.last:.3g}; split {counts} costs [{stages}] per stage."
    )
