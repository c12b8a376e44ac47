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
import functools
import math
import statistics
import time
from collections.abc import Callable, Iterator, Mapping
from dataclasses import dataclass
from pathlib import Path
from typing import Any, NamedTuple

import torch
import torch.distributed as dist
from torch import nn
from torch.distributed.pipelining._backward import stage_backward_input, stage_backward_weight
from torch.utils._python_dispatch import TorchDispatchMode
from torch.utils._pytree import tree_flatten, tree_map
from torch.utils.flop_counter import FlopCounterMode, _FlopCounterMode

from lightning_pp.memory.materialize import without_data
from lightning_pp.split.experts import EXPERTS_FLOPS
from lightning_pp.split.partition import Costs
from lightning_pp.split.pruned import sendable
from lightning_pp.split.transient import BackwardBytes


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
    clock = _Clock(device, module)
    with _untouched(module, device):
        # validation may come first: its batch is an inference tensor, which autograd cannot save
        args, kwargs = tree_map(lambda x: x.clone() if isinstance(x, torch.Tensor) else x, (args, kwargs))
        runs = [
            _timed_run(layers, lambda: forward(*args, **kwargs), clock.now, clock.cold).costs()
            for _ in range(repeats + 1)
        ]
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
    with _flop_counter() as counter, torch.enable_grad():
        return _timed_run(layers, run_forward, lambda: float(counter.get_total_flops())).costs()


def _grouped_mm_flops(a: torch.Size, b: torch.Size, *_: Any, out_shape: torch.Size, **__: Any) -> int:
    """The grouped matmul of transformers' MoE experts (``grouped_mm``, each token through its own experts), which
    torch's counter leaves out: ``a``'s last dimension contracted for each output element; where both operands are
    2-D (a weight gradient) the groups split that dimension, so they share it rather than each contracting all of it."""
    groups = 1 if len(a) == len(b) == 2 else math.prod(out_shape[:-2])
    return 2 * groups * out_shape[-2] * out_shape[-1] * a[-1]


def _grouped_mm_backward_flops(a: torch.Size, b: torch.Size, *_: Any, **__: Any) -> int:
    """transformers' fallback's backward (one op): the gradients of the input and of the weights, each as many FLOPs
    as the forward."""
    return 4 * a[0] * a[1] * b[-1]


@contextlib.contextmanager
def _flop_counter() -> Iterator[FlopCounterMode]:
    """torch's FLOP counter, counting MoE experts' grouped matmuls too: torch's, and in a trace (torch.export of a
    float32 model) transformers' ``grouped_mm_fallback`` custom ops, which the counter cannot see into, and the ops
    a trace records in place of experts sharded over replicas or adapted by LoRA. Its dispatch mode alone counts,
    not its per-module breakdown, whose tracker hooks each module's outputs with a hook that an ``autograd.grad``
    over leaves (torch's split backward, counted by ``count_segments``) cannot run ("A leaf node was passed to
    _will_engine_execute_node"); the total is the same."""
    formulas = {torch.ops.aten._grouped_mm: _grouped_mm_flops, **EXPERTS_FLOPS}
    fallback = torch.ops.transformers  # a namespace of ops transformers registers when its MoE code is imported
    if hasattr(fallback, "grouped_mm_fallback"):
        formulas[fallback.grouped_mm_fallback] = _grouped_mm_flops
    if hasattr(fallback, "grouped_mm_fallback_backward"):  # transformers >= 5.23; before, its mm's are seen
        formulas[fallback.grouped_mm_fallback_backward] = _grouped_mm_backward_flops
    counter = FlopCounterMode(display=False, custom_mapping=formulas)
    with _FlopCounterMode(counter), _GroupedInBf16():
        yield counter


class _GroupedInBf16(TorchDispatchMode):
    """torch's grouped_mm without data (its meta kernel) takes bf16 only, CUDA's kernel's rule, while the CPU's runs
    float32 too: counted without data, a grouped_mm of other dtypes runs in bf16 and hands back its own dtype (the
    same shapes and FLOPs), so a float32 MoE model built on meta is costed as it will train."""

    def __torch_dispatch__(self, func: Any, types: Any, args: tuple = (), kwargs: dict | None = None) -> Any:
        if func is torch.ops.aten._grouped_mm.default and args[0].dtype != torch.bfloat16 and without_data(args[0]):
            a, b = (t.to(torch.bfloat16) for t in args[:2])
            return func(a, b, *args[2:], **(kwargs or {})).to(args[0].dtype)
        return func(*args, **(kwargs or {}))


class _Clock:
    """Seconds once the device's queued work is done, less the time spent in ``cold``.

    In a pipeline, other micro-batches and the other ranks run between two uses of a layer: a model whose weights
    and gradients outgrow the device's last-level cache finds a stage's weights gone from it at each action, and
    timed warm, one segment after another, its small layers look cheaper than they run there. For such a model
    ``cold`` evicts the cache before each segment (reading a buffer twice its size) but for the segment's inputs,
    which come hot from the segment before; a model that fits stays warm in the pipeline too, and is timed so. On
    this project's CPU machine a GPT stage (4 blocks, d=256, 2 samples; 54 MiB of weights and gradients against a
    32 MiB cache) took 39.8 ms forward and backward in the pipeline, 36.2 profiled warm, 40.2 cold.
    """

    def __init__(self, device: torch.device, module: nn.Module) -> None:
        self._sync = torch.cuda.synchronize if device.type == "cuda" else (lambda: None)
        cache = _last_level_cache_bytes(device)
        outgrows = 2 * sum(p.nbytes for p in module.parameters()) > cache
        self._evictor = torch.ones(2 * cache // 4, device=device) if outgrows else None
        self._cold_s = 0.0

    def now(self) -> float:
        self._sync()
        return time.perf_counter() - self._cold_s

    def cold(self, *keep: Any) -> None:
        if self._evictor is None:
            return
        start = self.now()
        with torch.no_grad():
            self._evictor.sum()
            for t in tree_flatten(keep)[0]:
                if isinstance(t, torch.Tensor) and t.layout == torch.strided and not t.is_meta:
                    t.sum()
        self._cold_s += self.now() - start


def _last_level_cache_bytes(device: torch.device) -> int:
    """A GPU's L2, a CPU's largest cache (Linux says); 32 MiB where neither is known."""
    if device.type == "cuda":
        return torch.cuda.get_device_properties(device).L2_cache_size or 32 << 20
    units = {"K": 1 << 10, "M": 1 << 20, "G": 1 << 30}
    sizes = [0]
    for entry in Path("/sys/devices/system/cpu/cpu0/cache").glob("index*/size"):
        text = entry.read_text().strip()
        number, unit = (text[:-1], units[text[-1]]) if text[-1:] in units else (text, 1)
        sizes.append(int(number) * unit if number.isdigit() else 0)
    return max(sizes) or 32 << 20


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


class _Run(NamedTuple):
    """One forward and backward read off a clock, per segment: [before the layers, each layer, after them]."""

    forward: list[float]
    backward: list[float]

    def costs(self) -> Costs:
        """Forward plus backward per layer; the parts before and after the layers apart (the first backward
        segment, the embedding's, counts with the first layer: both always sit on the first stage)."""
        total = [f + b for f, b in zip(self.forward, self.backward)]
        return Costs([total[1] + self.backward[0], *total[2:-1]], first=self.forward[0], last=total[-1])


def _timed_run(
    layers: Mapping[str, nn.Module],
    run_forward: Callable[[], Any],
    now: Callable[[], float],
    cold: Callable[..., None] = lambda *_: None,
    backward_in: contextlib.AbstractContextManager | None = None,
) -> _Run:
    """Forward and backward of ``run_forward``'s outputs, read off the clock ``now`` (seconds, or FLOPs
    counted so far), ``cold`` called before each segment starts, the backward inside ``backward_in``."""
    n = len(layers)
    starts, ends = [0.0] * n, [0.0] * n
    grad_at: list[float | None] = [None] * n  # when backward reached each layer's output
    input_grad_at: list[float | None] = [None]  # when it reached the first layer's input

    def reached_input(grad: torch.Tensor) -> None:
        if input_grad_at[0] is None:
            cold(grad)
            input_grad_at[0] = now()

    def on_start(i: int) -> Callable[..., None]:
        def hook(_module: nn.Module, inputs: Any) -> None:
            cold(inputs)
            starts[i] = now()
            if i == 0:
                _on_gradients(inputs, reached_input)

        return hook

    def on_end(i: int) -> Callable[..., None]:
        def reached(grad: torch.Tensor) -> None:
            if grad_at[i] is None:
                cold(grad)
                grad_at[i] = now()

        def hook(_module: nn.Module, _inputs: Any, output: Any) -> None:
            if i == n - 1:
                cold(output)
            ends[i] = now()
            _on_gradients(output, reached)

        return hook

    handles = []
    for i, layer in enumerate(layers.values()):
        handles += [
            layer.register_forward_pre_hook(_eager(on_start(i))),
            layer.register_forward_hook(_eager(on_end(i))),
        ]
    try:
        cold()
        t0 = now()
        loss = sum_of_outputs(run_forward())
        t1 = now()
        cold()
        with backward_in or contextlib.nullcontext():
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
    first_input = input_grad_at[0] if input_grad_at[0] is not None else t2
    forward = [starts[i + 1] - starts[i] for i in range(n - 1)] + [ends[-1] - starts[-1]]
    backward = [first_input - reached[0]] + [reached[i - 1] - reached[i] for i in range(1, n)]
    return _Run([starts[0] - t0, *forward, t1 - ends[-1]], [t2 - first_input, *backward, reached[-1] - t1])


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


@dataclass(frozen=True)
class Segments:
    """One micro-batch of ``size`` samples through the user's step, per segment: [before the layers, each
    layer, after them (head and the user's loss)]. Seconds and bytes.

    ``input_grad`` and ``weight_grad`` are the halves the zero-bubble and V schedules run instead of
    ``backward``: measured on each layer alone with torch's own split backward (to the inputs, keeping the
    intermediates the weights need; then from those to the weights); the parts before and after the layers
    take the layers' mean proportions. ``boundary_bytes`` is what each segment hands to the next: a message between two
    stages, and what a recomputed layer keeps of the previous one.
    """

    size: int
    forward: tuple[float, ...]
    backward: tuple[float, ...]
    input_grad: tuple[float, ...]
    weight_grad: tuple[float, ...]
    saved_bytes: tuple[int, ...]
    boundary_bytes: tuple[int, ...]
    param_bytes: tuple[int, ...]
    backward_bytes: tuple[int, ...] = ()  # what each segment's backward holds beyond its saved bytes (none typed in)


def measure_segments(
    module: nn.Module, layers: Mapping[str, nn.Module], run_step: Callable[[], Any], size: int, repeats: int = 3
) -> Segments:
    """Time and count one micro-batch of ``size`` samples through ``run_step`` (the user's step, returning its
    loss) on a real module in one process; the module's gradients, buffers and random state stay as they were."""
    device = next(module.parameters()).device
    clock = _Clock(device, module)
    with _untouched(module, device):
        inputs: dict[int, tuple[tuple, dict]] = {}
        with _layer_inputs(layers, inputs), _SavedBytes(module, layers) as counted:
            loss = sum_of_outputs(run_step())
            with counted.backward:
                loss.backward()
        runs = [_timed_run(layers, run_step, clock.now, clock.cold) for _ in range(repeats + 1)][1:]
        split = [_split_backward(layer, *inputs[i], clock.now, repeats) for i, layer in enumerate(layers.values())]
    forward = [statistics.median(r.forward[k] for r in runs) for k in range(len(layers) + 2)]
    backward = [statistics.median(r.backward[k] for r in runs) for k in range(len(layers) + 2)]
    return _segments(module, size, _Run(forward, backward), split, counted)


def _segments(
    module: nn.Module, size: int, run: _Run, split: list[tuple[float, float, float]], counted: _SavedBytes
) -> Segments:
    """A step's ``run`` and each layer's backward run alone, whole and split (``split``: full, input half, weight
    half), as Segments: each layer's backward cut into halves in the shares its split took (split, a backward costs
    more than whole: torch's two passes each walk the graph), the parts before and after the layers in the layers'
    overall shares."""
    alone = sum(b for b, _, _ in split) or 1.0
    shares = [(sum(i for _, i, _ in split) / alone, sum(w for _, _, w in split) / alone)]
    shares = shares + [(i / (b or 1.0), w / (b or 1.0)) for b, i, w in split] + shares
    return Segments(
        size=size,
        forward=tuple(run.forward),
        backward=tuple(run.backward),
        input_grad=tuple(b * i for b, (i, _) in zip(run.backward, shares)),
        weight_grad=tuple(b * w for b, (_, w) in zip(run.backward, shares)),
        saved_bytes=tuple(counted.saved),
        boundary_bytes=tuple(counted.boundary),
        param_bytes=tuple(counted.param_bytes(module)),
        backward_bytes=tuple(counted.backward.peaks),
    )


class DeviceSpeed(NamedTuple):
    """How fast a device runs counted work: a matmul's FLOP/s, and the seconds each operation dispatched costs
    beside its FLOPs (Python, the dispatcher, autograd's bookkeeping, a kernel's launch). The second is what a
    small model's layers are made of: the default app's 64-wide GPT took 15x its FLOPs' time per layer at one
    sample on this project's CPU machine, about 10 us for each of a block's 134 operations."""

    flops_per_s: float
    seconds_per_op: float


class _Work(TorchDispatchMode):
    """Operations dispatched so far (each once, before the modes below it see it), beside torch's FLOP counter; not
    the ``prim`` queries a fake tensor answers by dispatch (its device: five per operation) and a real one does not."""

    def __init__(self, flops: FlopCounterMode) -> None:
        super().__init__()
        self.flops, self.ops = flops, 0

    def __torch_dispatch__(self, func: Any, types: Any, args: tuple = (), kwargs: dict | None = None) -> Any:
        self.ops += func.namespace != "prim"
        return func(*args, **(kwargs or {}))

    def seconds(self, speed: DeviceSpeed) -> float:
        return self.flops.get_total_flops() / speed.flops_per_s + self.ops * speed.seconds_per_op

    @contextlib.contextmanager
    def paused(self) -> Iterator[None]:
        """The block's operations not counted (the profile's own copies of a layer's inputs, which have no FLOPs)."""
        ops = self.ops
        yield
        self.ops = ops


@contextlib.contextmanager
def counted_work() -> Iterator[_Work]:
    """The FLOPs and operations dispatched inside the block, counted."""
    with _flop_counter() as flops, _Work(flops) as work:
        yield work


def count_segments(
    module: nn.Module, layers: Mapping[str, nn.Module], run_step: Callable[[], Any], size: int, speed: DeviceSpeed
) -> Segments:
    """``measure_segments`` for a module (and batch) without data (meta or fake tensors): each segment's forward and
    backward, and each layer's backward alone, whole and split, as long as the FLOPs and operations they dispatch
    take at ``speed``; saved bytes counted as they are."""
    inputs: dict[int, tuple[tuple, dict]] = {}
    with _untouched(module, torch.device("meta")), counted_work() as work:
        clock = functools.partial(work.seconds, speed)
        with _layer_inputs(layers, inputs, around=work.paused), _SavedBytes(module, layers) as counted:
            run = _timed_run(layers, run_step, clock, backward_in=counted.backward)
        split, counts = [], {}  # a layer alike one counted before counts the same
        for i, layer in enumerate(layers.values()):
            key = _alike(layer, *inputs[i])
            if key not in counts:
                counts[key] = _split_backward(layer, *inputs[i], clock, 1, warm_up=0)
            split.append(counts[key])
    return _segments(module, size, run, split, counted)


def _alike(layer: nn.Module, args: tuple, kwargs: dict) -> tuple:
    """What a layer's count depends on: its class, its parameters' shapes and dtypes and which train, and its
    inputs' (the blocks of a transformer are alike)."""

    def described(t: Any) -> Any:
        return (tuple(t.shape), t.dtype, t.requires_grad) if isinstance(t, torch.Tensor) else repr(t)

    params = tuple((n, described(p)) for n, p in layer.named_parameters())
    leaves, spec = tree_flatten((args, kwargs))
    return type(layer), params, str(spec), tuple(map(described, leaves))


@contextlib.contextmanager
def _layer_inputs(
    layers: Mapping[str, nn.Module],
    into: dict[int, tuple[tuple, dict]],
    around: Callable[[], contextlib.AbstractContextManager] = contextlib.nullcontext,
) -> Iterator[None]:
    """Detached copies of what each layer receives, for running it alone, each made inside ``around()``."""

    def keep(i: int) -> Callable[..., None]:
        def hook(_module: nn.Module, args: tuple, kwargs: dict) -> None:
            with around():
                into[i] = tree_map(lambda t: t.detach().clone() if isinstance(t, torch.Tensor) else t, (args, kwargs))

        return hook

    handles = [
        layer.register_forward_pre_hook(_eager(keep(i)), with_kwargs=True) for i, layer in enumerate(layers.values())
    ]
    try:
        yield
    finally:
        for h in handles:
            h.remove()


def _split_backward(
    layer: nn.Module, args: tuple, kwargs: dict, now: Callable[[], float], repeats: int, warm_up: int = 1
) -> tuple[float, float, float]:
    """Seconds of one layer's full backward, and of its input and weight halves, run alone (the median of
    ``repeats`` runs after ``warm_up``)."""
    params = [p for p in layer.parameters() if p.requires_grad]
    full, first, second = [], [], []
    for _ in range(warm_up + repeats):
        a, kw = tree_map(
            lambda t: t.detach().requires_grad_(t.is_floating_point()) if isinstance(t, torch.Tensor) else t,
            (args, kwargs),
        )
        leaves = [t for t in tree_flatten((a, kw))[0] if isinstance(t, torch.Tensor) and t.requires_grad]
        out = tree_flatten(layer(*a, **kw))[0]  # handed on as a stage hands it (not a view: the input pass detaches it)
        outputs = [sendable(t) for t in out if isinstance(t, torch.Tensor) and t.requires_grad]
        grads = [torch.ones_like(t) for t in outputs]
        t0 = now()
        _, param_groups = stage_backward_input(outputs, grads, leaves, iter(params))
        t1 = now()
        stage_backward_weight(iter(params), param_groups)
        t2 = now()
        outputs = [t for t in tree_flatten(layer(*a, **kw))[0] if isinstance(t, torch.Tensor) and t.requires_grad]
        t3 = now()
        torch.autograd.backward(outputs, grads)
        full.append(now() - t3)
        first.append(t1 - t0)
        second.append(t2 - t1)
    return tuple(statistics.median(x[warm_up:]) for x in (full, first, second))  # type: ignore[return-value]


class _SavedBytes:
    """Bytes autograd saves for backward in each segment (each storage once, parameters excluded, counted where
    first saved), the bytes each segment hands to the next, and (``backward``, entered around the backward pass)
    what each segment's backward holds beyond them."""

    def __init__(self, module: nn.Module, layers: Mapping[str, nn.Module]) -> None:
        self._params = {p.untyped_storage()._cdata for p in module.parameters()}
        self._layers = list(layers.values())
        n = len(self._layers)
        self.saved = [0] * (n + 2)
        self.boundary = [0] * (n + 2)
        self.backward = BackwardBytes(n + 2)
        self._seen: set[int] = set()
        self._segment = 0
        self._used: dict[nn.Module, int] = {}  # the segment where each module first runs

    def param_bytes(self, module: nn.Module) -> list[int]:
        """Parameter bytes of each segment: each module's own parameters where it first ran (a tied embedding and
        head count on both ends, as the pipeline holds a copy on each), parameters of modules that never ran on the
        first segment."""
        out = [0] * len(self.saved)
        for m in module.modules():
            out[self._used.get(m, 0)] += sum(p.nbytes for p in m.parameters(recurse=False))
        for i, layer in enumerate(self._layers):
            for m in layer.modules():
                out[self._used.get(m, 0)] -= sum(p.nbytes for p in m.parameters(recurse=False))
            out[i + 1] += sum(p.nbytes for p in layer.parameters())
        return out

    def _ran(self, m: nn.Module, _inputs: Any) -> None:
        self._used.setdefault(m, self._segment)

    def _pack(self, tensor: torch.Tensor) -> torch.Tensor:
        key = tensor.untyped_storage()._cdata
        if key not in self._params and key not in self._seen:
            self._seen.add(key)
            self.saved[self._segment] += tensor.untyped_storage().nbytes()
            self.backward.watch(tensor.untyped_storage())
        return tensor

    def _enter(self, i: int) -> Callable[..., None]:
        def hook(_module: nn.Module, args: tuple, kwargs: dict) -> None:
            self.boundary[i] = _nbytes((args, kwargs))  # segment i (before, or the previous layer) hands this on
            self._segment = i + 1
            _on_gradients((args, kwargs), lambda _grad: self.backward.reached(i))  # segment i's backward begins

        return hook

    def _leave(self, i: int) -> Callable[..., None]:
        def hook(_module: nn.Module, _inputs: Any, output: Any) -> None:
            if i == len(self._layers) - 1:
                self.boundary[i + 1] = _nbytes(output)
                self._segment = i + 2
                _on_gradients(output, lambda _grad: self.backward.reached(i + 1))  # the last layer's backward begins

        return hook

    def __enter__(self) -> _SavedBytes:
        self._handles = [
            h
            for i, layer in enumerate(self._layers)
            for h in (
                layer.register_forward_pre_hook(_eager(self._enter(i)), with_kwargs=True),
                layer.register_forward_hook(_eager(self._leave(i))),
            )
        ]
        self._handles.append(nn.modules.module.register_module_forward_pre_hook(_eager(self._ran)))
        self._hooks = torch.autograd.graph.saved_tensors_hooks(_eager(self._pack), lambda t: t)
        self._hooks.__enter__()
        return self

    def __exit__(self, *exc: Any) -> None:
        self._hooks.__exit__(*exc)
        for h in self._handles:
            h.remove()


def _eager(hook: Callable[..., Any]) -> Callable[..., Any]:
    """``hook`` run as Python inside a block the user compiled (``block.compile()`` traces the block's hooks, and
    runs every Python frame called under it through dynamo): dynamo cannot read sizes, clocks or storages off its
    fake tensors, and recompiles a hook per tensor stride until its limit."""
    return torch.compiler.disable(hook, recursive=True)


def _on_gradients(tree: Any, hook: Callable[[torch.Tensor], None]) -> None:
    """``hook`` called with each gradient of ``tree``'s tensors that need one, as backward computes it."""
    for t in tree_flatten(tree)[0]:
        if isinstance(t, torch.Tensor) and t.requires_grad:
            t.register_hook(hook)


def _nbytes(tree: Any) -> int:
    return sum(t.nbytes for t in tree_flatten(tree)[0] if isinstance(t, torch.Tensor) and t.is_floating_point())
