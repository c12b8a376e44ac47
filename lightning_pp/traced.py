"""``split="trace"``: the model the step calls, traced by torch's pipeline tracer and split at layer boundaries.

For forwards that do not skip ``None`` parts (HF transformers, litgpt, nanoGPT). Every trace runs on a
meta copy of the model made at the first batch (the *skeleton*), so tracing costs no memory and may
happen again after the rank has freed the stages it does not hold: the trace freezes shapes and
train/eval mode, so the last partial batch and validation need their own. A traced piece names its
parameters as the model does (``transformer.h.5.attn.c_attn.weight``): each of this rank's pieces
adopts the rank's real tensors by name from its stage's view (the tracer's copies of tied weights
included, so they train, and are summed, as the one tensor they are), and the meta device the trace
recorded in its operations becomes the rank's device.

Inputs a later stage needs from the batch (``labels=`` when the model computes its own loss) are
looked up in the local call, which every stage of a pipeline has: torch's own ``build_stage`` cannot
receive them. The last piece's flat outputs are rebuilt into the structure the model returns (an HF
``ModelOutput``, a tuple, a tensor), learned from a forward of the skeleton on meta.
"""

from __future__ import annotations

import contextlib
import copy
import inspect
import operator
from collections.abc import Iterator
from dataclasses import dataclass
from itertools import chain
from typing import Any

import torch
from torch import fx, nn
from torch.fx.node import map_aggregate
from torch.utils._pytree import TreeSpec, tree_flatten, tree_map_only, tree_unflatten

from lightning_pp.errors import PipelineConfigError
from lightning_pp.materialize import on_meta
from lightning_pp.microbatch import ModelCall, signature
from lightning_pp.partition import Balance, Costs, resolve_balance, stage_of_each_layer
from lightning_pp.stage import Placement, find_layers, find_ties, get_path, parts_and_params, patched
from lightning_pp.step import StageModule, StageModules

_ALTERNATIVES = (
    "split='prune' (the default) with a forward that skips the parts other stages hold (`h = self.wte(x) if"
    " self.wte is not None else x`, see the README's seed convention), or a model family the README lists as"
    " traceable"
)


@dataclass(frozen=True)
class _Trace:
    """The tracer's pieces (on meta) and how to feed and read them."""

    pieces: list[nn.Module]
    # for each piece, where each of its inputs comes from: ("act", index into what the previous stage sent)
    # or ("root", the name of the model's forward parameter it is)
    sources: list[list[tuple[str, Any]]]
    outputs: list[int]  # the last piece's outputs, in the order of the model output's leaves
    out_spec: TreeSpec


class Tracer:
    """Traces of the model the step calls, one per (train/eval, micro-batch signature), on a meta skeleton."""

    def __init__(self, module: nn.Module, entry: str, layers: str, counts: tuple[int, ...]) -> None:
        self.entry = entry
        self._prefix = entry + "." if entry else ""
        relative = layers[len(self._prefix) :]
        keys = list(find_layers(module, layers))
        firsts = [sum(counts[:s]) for s in range(1, len(counts))]
        self.split_points = [f"{relative}.{keys[i]}" for i in firsts]
        self.n_stages = len(counts)
        model = get_path(module, entry)
        # deep-copied while every tensor is a meta stand-in (ties kept); a LightningModule's Trainer stays out
        with on_meta(module), patched(module, _trainer=None) if not entry else contextlib.nullcontext():
            self.skeleton = copy.deepcopy(model)
        self._traces: dict[tuple, _Trace] = {}

    def trace(self, train: bool, call: ModelCall) -> _Trace:
        key = (train, signature((call.args, call.kwargs)))
        if key not in self._traces:
            self._traces[key] = _trace(self.skeleton, train, call, self.split_points, self.n_stages)
        return self._traces[key]

    def names_per_stage(self, trace: _Trace) -> list[set[str]]:
        """The whole module's names of the parameters and buffers each stage's piece uses."""
        return [{self._prefix + n for n, _ in _tensors(piece)} for piece in trace.pieces]

    def stages(self, views: dict[int, nn.Module], device: torch.device) -> StageModules:
        """This rank's stage modules for a batch: its pieces of that batch's trace, holding the real tensors."""
        built: dict[int, list[StageModule]] = {}

        def make(train: bool, call: ModelCall) -> list[StageModule]:
            trace = self.trace(train, call)
            if id(trace) not in built:
                built[id(trace)] = [
                    _TracedStage(_adopt(trace.pieces[s], views[s], self._prefix, device), s, trace, self.skeleton)
                    for s in views
                ]
            return built[id(trace)]

        return make


def traced_placement(
    module: nn.Module, layers: str, n_stages: int, balance: Balance, call: ModelCall, train: bool
) -> tuple[Placement, Tracer]:
    """The placement a first trace gives (layers by ``balance``, every other part where the pieces use it),
    and the tracer for later traces; on every rank alike, before any collective."""
    if isinstance(balance, str) and balance.lower() == "profile":
        raise PipelineConfigError(
            "balance='profile' is not supported with split='trace' yet; use balance='parameters', 'uniform' or"
            " a list of layer counts."
        )
    keys = tuple(find_layers(module, layers))
    counts = tuple(resolve_balance(balance, len(keys), n_stages, _layer_costs(module, layers)))
    if not layers.startswith(call.entry):
        raise PipelineConfigError(f"The step calls '{call.entry}', which does not hold the layers at {layers!r}.")
    tracer = Tracer(module, call.entry, layers, counts)
    held = tracer.names_per_stage(tracer.trace(train, call))
    layer_stage = stage_of_each_layer(counts)
    for key, stage in zip(keys, layer_stage):
        names = {f"{layers}.{key}.{n}" for n, _ in _tensors(find_layers(module, layers)[key])}
        if not names <= held[stage]:
            raise PipelineConfigError(
                f"The traced pieces do not split {type(tracer.skeleton).__name__} at its layers: layer {key!r} of"
                f" {layers!r} should be on stage {stage}. Pass the container whose entries forward calls one after"
                " another as layers=."
            )
    parts, params = parts_and_params(module, layers)

    def stages_of(name: str, has_tensors: bool) -> tuple[int, ...]:
        found = tuple(s for s in range(n_stages) if any(n == name or n.startswith(name + ".") for n in held[s]))
        return found or ((n_stages - 1,) if has_tensors else tuple(range(n_stages)))

    placed_parts = {n: stages_of(n, any(True for _ in _tensors(part))) for n, part in parts.items()}
    placed_params = {n: stages_of(n, True) for n in params}
    placement = Placement(layers, keys, counts, placed_parts, placed_params)
    return Placement(layers, keys, counts, placed_parts, placed_params, find_ties(module, placement)), tracer


def _layer_costs(module: nn.Module, layers: str) -> Costs:
    costs = [float(sum(p.numel() for p in layer.parameters())) for layer in find_layers(module, layers).values()]
    return Costs(costs, 0.0, 0.0)


def _trace(skeleton: nn.Module, train: bool, call: ModelCall, split_points: list[str], n_stages: int) -> _Trace:
    from torch.distributed.pipelining import SplitPoint, pipeline

    name = type(skeleton).__name__
    config = getattr(skeleton, "config", None)
    if getattr(config, "use_cache", False) and call.kwargs.get("use_cache") is not False:
        raise PipelineConfigError(
            f"{name} has config.use_cache=True: a key/value cache cannot be traced into pipeline stages (and"
            " training does not use it). Set `model.config.use_cache = False` before training, or call the model"
            " with use_cache=False."
        )
    args, kwargs = tree_map_only(torch.Tensor, lambda t: t.to("meta"), (call.args, call.kwargs))
    skeleton.train(train)
    specs: list[TreeSpec] = []  # the output's structure, seen as the tracer runs forward (eagerly, on fake tensors)
    hook = skeleton.register_forward_hook(lambda _, __, out: specs.append(tree_flatten(out)[1]))
    try:
        pipe = pipeline(skeleton, args, kwargs, split_spec={p: SplitPoint.BEGINNING for p in split_points})
        out_spec = specs[-1]
        pieces = [pipe.split_gm.get_submodule(f"submod_pp_{i}") for i in range(pipe.num_stages)]
        if len(pieces) != n_stages:
            raise PipelineConfigError(f"the tracer made {len(pieces)} pieces, not {n_stages}")
        sources, outputs = _wiring(pipe.split_gm.graph)
        bound = _bind(skeleton, args, kwargs)
        received: tuple = ()
        for piece, wants in zip(pieces, sources):  # run once on meta: torch's split can miswire a graph
            out = piece(*[received[k] if kind == "act" else bound[k] for kind, k in wants])
            received = out if isinstance(out, tuple) else (out,)
    except PipelineConfigError:
        raise
    except Exception as error:
        cause = error
        while cause.__cause__ is not None:  # torch wraps the tracer's own error in a generic one
            cause = cause.__cause__  # type: ignore[assignment]
        reason = (str(cause).strip().splitlines() or [""])[0]
        raise PipelineConfigError(
            f"split='trace' cannot trace and split {name} with torch.distributed.pipelining ({type(cause).__name__}:"
            f" {reason}). Use {_ALTERNATIVES}."
        ) from error
    finally:
        hook.remove()
        for point in split_points:  # pipeline() wraps the split modules' forward
            skeleton.get_submodule(point).__dict__.pop("forward", None)
    return _Trace(pieces, sources, outputs, out_spec)


def _wiring(graph: fx.Graph) -> tuple[list[list[tuple[str, Any]]], list[int]]:
    """From the tracer's root graph: each piece's inputs (previous stage's outputs, or the model's inputs by
    name), and which of the last piece's outputs make up the model's output, in order."""
    stage_of = {n: i for i, n in enumerate(n for n in graph.nodes if n.op == "call_module")}

    def source(node: fx.Node, consumer: int) -> tuple[str, Any]:
        if node.op == "placeholder":
            return ("root", node.target)
        producer, index = (node.args[0], node.args[1]) if node.target is operator.getitem else (node, 0)
        if stage_of.get(producer) != consumer - 1:  # type: ignore[arg-type]
            raise PipelineConfigError(
                f"the traced graph passes {node.name} from a stage to a later one that is not the next; pipelining"
                " sends activations from each stage to the next only"
            )
        return ("act", index)

    sources = [[source(a, i) for a in node.args] for node, i in stage_of.items()]  # type: ignore[arg-type]
    (result,) = (n for n in graph.nodes if n.op == "output")
    leaves = result.args[0] if isinstance(result.args[0], (tuple, list)) else (result.args[0],)
    outputs = [source(leaf, len(stage_of))[1] for leaf in leaves]
    return sources, outputs


def _bind(model: nn.Module, args: tuple, kwargs: dict) -> dict[str, Any]:
    """The call's tensors by the name of the forward parameter they are (the tracer's names for its inputs)."""
    bound = inspect.signature(type(model).forward).bind(model, *args, **kwargs)
    named = dict(bound.arguments)
    for param in bound.signature.parameters.values():
        if param.kind is inspect.Parameter.VAR_KEYWORD:
            named.update(named.pop(param.name, {}))
    return named


def _tensors(module: nn.Module) -> Iterator[tuple[str, torch.Tensor]]:
    return chain(module.named_parameters(remove_duplicate=False), module.named_buffers(remove_duplicate=False))


def _adopt(piece: nn.Module, view: nn.Module, prefix: str, device: torch.device) -> nn.Module:
    """``piece`` holding the view's real tensors under the same names, and running on ``device``."""
    for name, _ in list(_tensors(piece)):
        *path, attr = name.split(".")
        owner = piece.get_submodule(".".join(path))
        real = get_path(view, prefix + name)
        slots = owner._parameters if attr in owner._parameters else owner._buffers
        slots[attr] = real
    for sub in piece.modules():
        graph = getattr(sub, "graph", None)
        if isinstance(graph, fx.Graph):
            for node in graph.nodes:
                node.args = map_aggregate(node.args, lambda v: _device(v, device))
                node.kwargs = map_aggregate(node.kwargs, lambda v: _device(v, device))
            if isinstance(sub, fx.GraphModule):
                sub.recompile()
        constants = [k for k, v in vars(sub).items() if isinstance(v, torch.Tensor) and v.is_meta]
        if constants:
            # a tensor made by forward itself, recorded by the trace on meta: its values are lost
            raise PipelineConfigError(
                f"The traced piece holds tensors that forward creates from values ({constants}), which a trace on"
                f" the meta device cannot keep. Register them as buffers in __init__, or use {_ALTERNATIVES}."
            )
    return piece


def _device(value: Any, device: torch.device) -> Any:
    return device if isinstance(value, torch.device) and value.type == "meta" else value


class _TracedStage(StageModule):
    """One traced piece: the previous stage's outputs and the call's own inputs in, the model's output out."""

    def __init__(self, piece: nn.Module, index: int, trace: _Trace, model: nn.Module) -> None:
        super().__init__(is_last=index == len(trace.pieces) - 1)
        self.piece = piece
        self._model = [model]  # for its forward's signature (a list: not a submodule)
        self.sources = trace.sources[index]
        self._outputs, self._out_spec = trace.outputs, trace.out_spec

    def forward(self, *received: torch.Tensor, mb: torch.Tensor) -> Any:
        index, (_, args, kwargs) = self.call_of(mb)
        bound = _bind(self._model[0], args, kwargs) if any(kind == "root" for kind, _ in self.sources) else {}
        out = self.piece(*[received[k] if kind == "act" else bound[k] for kind, k in self.sources])
        flat = out if isinstance(out, tuple) else (out,)
        if self.is_last:
            return self.keep_output(index, tree_unflatten([flat[k] for k in self._outputs], self._out_spec))
        return flat
