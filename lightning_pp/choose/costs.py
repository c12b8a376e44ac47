"""A model's costs measured in this process: each layer's forward, backward and split backward at several
micro-batch sizes cut from a real batch, the activations it saves, its parameters, and its optimizer's state and
step (or, for a model built on meta, its FLOPs counted). The planner's app and schedule="auto" start from them."""

from __future__ import annotations

import functools
import hashlib
import json
import statistics
import sys
import time
from collections.abc import Sequence
from dataclasses import asdict, replace
from pathlib import Path
from typing import Any

import lightning as L
import torch
from torch import nn
from torch._subclasses.fake_tensor import DataDependentOutputException, DynamicOutputShapeException
from torch.utils._pytree import tree_flatten

from lightning_pp.choose.machine import cache_path, write_cache
from lightning_pp.choose.planner import ModelCosts
from lightning_pp.errors import PipelineConfigError
from lightning_pp.memory.materialize import on_fake
from lightning_pp.split.experts import eager_experts_fix, fallback_backward_fix
from lightning_pp.split.microbatch import batch_size_of, split_batch
from lightning_pp.split.profiling import DeviceSpeed, Segments, count_segments, measure_segments, sum_of_outputs
from lightning_pp.split.stage import find_layers, patched, resolve_layers, without_kv_cache


def profile_module(module: L.LightningModule, batch: Any, layers: str | None, sizes: Sequence[int]) -> ModelCosts:
    """Costs of ``module``'s own training step on micro-batches of ``sizes`` samples cut from ``batch``, and of its
    optimizer: one process, the module as it is (on the CPU here) but for a key/value cache, which the pipeline does
    not build; its weights and gradients are left as they were."""
    blocks = find_layers(module, resolve_layers(module, layers))
    full = batch_size_of(batch)
    measured = []
    with patched(module, log=lambda *_, **__: None), without_kv_cache(module):
        for size in sorted(set(sizes)):
            micro = split_batch(batch, full // size)[0]
            measured.append(measure_segments(module, blocks, lambda micro=micro: module.training_step(micro, 0), size))
        ratio, seconds = _optimizer_costs(module, lambda: module.training_step(split_batch(batch, full)[0], 0))
    return ModelCosts(tuple(measured), ratio, seconds)


def counted_costs(
    module: L.LightningModule,
    batch: Any,
    layers: str | None,
    sizes: Sequence[int],
    speed: DeviceSpeed,
    device: torch.device,
) -> ModelCosts:
    """A module built on meta, or one whose weights stay where they are: the FLOPs and operations of its own step
    counted on fake tensors at micro-batches of ``sizes`` samples, at the rank's device's ``speed`` (a matmul's FLOP/s
    and a small operation's seconds; memory-bound work is missed) as the code runs on ``device``; the optimizer
    costed as Adam's state and no time. Nothing runs on the module's own tensors."""
    blocks = find_layers(module, resolve_layers(module, layers))
    full = batch_size_of(batch)
    measured = []
    try:
        with on_fake(module, device) as fake, patched(module, log=lambda *_, **__: None), without_kv_cache(module):
            faked = fake(batch)
            for size in sorted(set(sizes)):
                micro = split_batch(faked, full // size)[0]
                step = functools.partial(module.training_step, micro, 0)
                measured.append(count_segments(module, blocks, step, size, speed))
    except (DataDependentOutputException, DynamicOutputShapeException) as error:
        fix = eager_experts_fix(module) or fallback_backward_fix(module)
        raise PipelineConfigError(
            f"{type(module).__name__}'s step asks its tensors' values ({error}), which a model costed by its FLOPs"
            f" (built on meta, or too large to measure on {device}) does not have{'. ' + fix if fix else ''}"
        ) from error
    return ModelCosts(tuple(measured))


def profiled_sizes(batch_size: int) -> list[int]:
    """The smallest, a middle and the largest micro-batch the plan may use: costs are affine in between."""
    sizes = [batch_size // m for m in range(1, batch_size + 1) if batch_size % m == 0]
    return sorted({sizes[-1], sizes[len(sizes) // 2], sizes[0]})


def mean_costs(every: Sequence[ModelCosts]) -> ModelCosts:
    """Several ranks' costs of one model as one: their times averaged; the bytes, the same on every rank, kept."""
    measured = tuple(
        replace(
            first, **{k: tuple(map(statistics.fmean, zip(*(getattr(c.measured[i], k) for c in every)))) for k in _TIMES}
        )
        for i, first in enumerate(every[0].measured)
    )
    return replace(
        every[0], measured=measured, optimizer_s_per_byte=statistics.fmean(c.optimizer_s_per_byte for c in every)
    )


_TIMES = ("forward", "backward", "input_grad", "weight_grad")


def _optimizer_costs(module: L.LightningModule, run_step: Any, repeats: int = 3) -> tuple[float, float]:
    """The optimizer's state bytes per parameter byte, and seconds per parameter byte of one step."""
    optimizer = _first_optimizer(module.configure_optimizers())
    params = [p for group in optimizer.param_groups for p in group["params"]]
    nbytes = sum(p.nbytes for p in params) or 1
    before = [p.detach().clone() for p in params]
    sum_of_outputs(run_step()).backward()  # a loss, or Lightning's {"loss": ...}
    times = []
    for _ in range(repeats + 1):
        start = time.perf_counter()
        optimizer.step()
        times.append(time.perf_counter() - start)
    state = sum(t.nbytes for s in optimizer.state.values() for t in s.values() if isinstance(t, torch.Tensor))
    optimizer.zero_grad(set_to_none=True)
    with torch.no_grad():  # the module leaves as it came
        for p, value in zip(params, before):
            p.copy_(value)
    return state / nbytes, statistics.median(times[1:]) / nbytes


def _first_optimizer(configured: Any) -> torch.optim.Optimizer:
    """The optimizer of ``configure_optimizers``' return value (an optimizer, a list or tuple, or a dict)."""
    if isinstance(configured, torch.optim.Optimizer):
        return configured
    if isinstance(configured, dict):
        return _first_optimizer(configured["optimizer"])
    if isinstance(configured, (list, tuple)) and configured:
        return _first_optimizer(configured[0])
    raise TypeError(f"configure_optimizers returned {configured!r}: the planner needs an optimizer to cost.")


_LIBRARIES = ("torch", "lightning", "builtins", "abc", "typing")
_FORMAT = "operations counted"  # what changed last in Segments or in how they are counted


def _signature(module: nn.Module, batch: Any, layers: str | None) -> str:
    """The model (its classes' code, parameter names, shapes and dtypes: a step or a layer edited between two runs
    is measured again), torch's and Lightning's releases, its layers and the batch's shapes and device
    type (where the costs were measured: a GPU run's are not a CPU run's of the same model) with the device's
    autocast (a bf16-mixed run's step is not a 32-true one's), and what the costs hold (``_FORMAT``: costs cached
    before a field was measured are measured again, not read without it)."""
    parts = [_FORMAT, torch.__version__, L.__version__, type(module).__qualname__, str(layers), *_code(module)]
    parts += [f"{n}:{tuple(p.shape)}:{p.dtype}" for n, p in module.named_parameters()]
    tensors = [t for t in tree_flatten(batch)[0] if isinstance(t, torch.Tensor)]
    parts += [f"{tuple(t.shape)}:{t.dtype}:{t.device.type}" for t in tensors]
    for kind in sorted({t.device.type for t in tensors}):
        parts += [f"autocast:{kind}:{torch.get_autocast_dtype(kind)}"] if torch.is_autocast_enabled(kind) else []
    return hashlib.sha256("|".join(parts).encode()).hexdigest()[:16]


def _code(module: nn.Module) -> list[str]:
    """A digest of each source file that defines a class of ``module``'s modules or their bases, but torch's and
    Lightning's (their releases decide theirs): a file edited anywhere is measured again, a step or layer with it."""
    classes = {c for m in module.modules() for c in type(m).__mro__ if c.__module__.split(".")[0] not in _LIBRARIES}
    files = {getattr(sys.modules.get(c.__module__), "__file__", None) or c.__module__ for c in classes}
    digests = []
    for name in sorted(files):
        try:
            digests.append(f"{name}:{hashlib.sha256(Path(name).read_bytes()).hexdigest()[:16]}")
        except OSError:
            digests.append(name)  # no file (a notebook's cell): its name
    return digests


def saved_costs(module: nn.Module, batch: Any, layers: str | None) -> ModelCosts | None:
    """The costs measured for this model and batch shape on this host before (a restarted run's)."""
    path = cache_path("costs", _signature(module, batch, layers))
    try:
        saved = json.loads(path.read_text())
    except (OSError, ValueError):
        return None
    measured = tuple(
        Segments(**{k: tuple(v) if isinstance(v, list) else v for k, v in s.items()}) for s in saved["measured"]
    )
    return ModelCosts(measured, saved["optimizer_state_ratio"], saved["optimizer_s_per_byte"])


def save_costs(costs: ModelCosts, module: nn.Module, batch: Any, layers: str | None) -> None:
    write_cache(cache_path("costs", _signature(module, batch, layers)), asdict(costs))
