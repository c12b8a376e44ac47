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
import functools
import inspect
import operator
import re
import warnings
from collections.abc import Callable, Iterator, Mapping
from dataclasses import dataclass
from itertools import chain
from typing import Any

import torch
from lightning.pytorch.utilities.rank_zero import rank_zero_info
from torch import fx, nn
from torch.fx.node import map_aggregate
from torch.overrides import TorchFunctionMode
from torch.utils._pytree import TreeSpec, tree_flatten, tree_map_only, tree_unflatten

from lightning_pp.errors import PipelineConfigError
from lightning_pp.layout.options import Balance
from lightning_pp.memory.materialize import on_meta
from lightning_pp.memory.recompute import marked_by_the_model
from lightning_pp.split.experts import (
    EXPERTS_OP,
    call_eager,
    eager_experts_fix,
    fallback_backward_fix,
    opaque_adapted_experts,
)
from lightning_pp.split.microbatch import ModelCall, signature
from lightning_pp.split.partition import Costs, resolve_balance, stage_of_each_layer
from lightning_pp.split.peft_trace import traceable_adapters, untraced_adapters_fix
from lightning_pp.split.profiling import describe_costs, flops_of
from lightning_pp.split.pruned import StageModule, StageModules, sendable
from lightning_pp.split.stage import (
    Placement,
    configs_with,
    find_layers,
    find_ties,
    get_path,
    is_compiled,
    parts_and_params,
    patched,
)

_ALTERNATIVES = (
    "split='prune' (the default) with a forward that skips the parts other stages hold (`h = self.wte(x) if"
    " self.wte is not None else x`, see the README's seed convention), or a model family docs/models.md lists as"
    " traceable"
)


_Key = tuple[int, int]  # (stage, index): one output of one traced piece


_Binding = tuple[dict[str, Any], str, str]  # a module's slots, the slot, the view's name for its tensor


@dataclass(frozen=True)
class _Trace:
    """The tracer's pieces (on meta) and how values flow between them.

    torch's manual ``PipelineStage`` receives from the previous stage only, but a traced graph may hand a
    value (an attention mask, position ids) from one piece to several later ones: each stage sends on what
    later stages need (``carry``), its own outputs and what it received.
    """

    pieces: list[nn.Module]
    # each piece's inputs: ("act", (stage, index)) an earlier piece's output, or ("root", the forward parameter)
    sources: list[list[tuple[str, Any]]]
    carry: list[list[_Key]]  # what stage s sends to stage s + 1
    outputs: list[_Key]  # the model output's leaves, in order
    out_spec: TreeSpec

    def run(self, stage: int, received: tuple, bound: dict[str, Any], piece: nn.Module | None = None) -> dict:
        """Stage ``stage`` on what it received and the call's inputs: every value it knows, by key."""
        values = dict(zip(self.carry[stage - 1], received)) if stage else {}
        inputs = [values[ref] if kind == "act" else bound[ref] for kind, ref in self.sources[stage]]
        out = (piece or self.pieces[stage])(*inputs)
        values.update({(stage, k): v for k, v in enumerate(out if isinstance(out, tuple) else (out,))})
        return values


class Tracer:
    """Traces of the model the step calls, one per (train/eval, micro-batch signature), on a meta skeleton."""

    def __init__(self, module: nn.Module, entry: str, layers: str, counts: tuple[int, ...]) -> None:
        self.entry = entry
        self._prefix = entry + "." if entry else ""
        relative = layers[len(self._prefix) :]
        found = find_layers(module, layers)
        keys = list(found)
        firsts = [sum(counts[:s]) for s in range(1, len(counts))]
        self.split_points = [f"{relative}.{keys[i]}" for i in firsts]
        self.n_stages = len(counts)
        model = get_path(module, entry)
        _refuse_compiled(model, self._prefix)
        self.checkpointed = marked_by_the_model(found)  # recomputed by each rank's pieces (see Holding)
        if self.checkpointed:
            _say_once(
                f"{layers}: {len(self.checkpointed)} of {len(keys)} layers have transformers' gradient checkpointing"
                " on (gradient_checkpointing_enable()): each rank's traced pieces recompute them in backward, as"
                " activation_checkpointing=True does, which a trace would otherwise leave out."
            )
        # deep-copied while every tensor is a meta stand-in (ties kept); a LightningModule's Trainer stays out
        with on_meta(module), patched(module, _trainer=None) if not entry else contextlib.nullcontext():
            self.skeleton = copy.deepcopy(model)
        _without_cache(self.skeleton)
        _say_router_loss(self.skeleton)
        traceable_adapters(self.skeleton, opaque_adapted_experts(self.skeleton, self._prefix))
        self._traces: dict[tuple, _Trace] = {}

    def trace(self, train: bool, call: ModelCall) -> _Trace:
        key = (train, signature((call.args, call.kwargs)))
        if key not in self._traces:
            self._traces[key] = _trace(self.skeleton, train, call, self.split_points, self.n_stages)
        return self._traces[key]

    def flop_costs(self, train: bool, call: ModelCall) -> Costs:
        """FLOPs of forward and backward per layer (and before and after the layers), counted on meta by running
        the pieces one after another: the same on every rank, no weights, no memory; a model built on meta
        too (Hugging Face's eager forward cannot run on meta)."""
        trace = self.trace(train, call)
        layers = {k: m for piece in trace.pieces for k, m in self._layers_of(piece).items()}
        args, kwargs = tree_map_only(torch.Tensor, lambda t: t.to("meta"), (call.args, call.kwargs))
        bound = _bind(self.skeleton, args, kwargs)

        def run() -> tuple:
            received: tuple = ()
            for stage in range(self.n_stages):
                values = trace.run(stage, received, bound)
                received = tuple(values[key] for key in (trace.carry + [trace.outputs])[stage])
            return received

        try:
            return flops_of(layers, run)
        except NotImplementedError as error:  # "Cannot copy out of meta tensor"
            fix = fallback_backward_fix(self.skeleton)
            if not fix:
                raise
            raise PipelineConfigError(
                f"{type(self.skeleton).__name__} cannot be costed on meta ({error}). {fix}."
            ) from error
        finally:
            self.skeleton.zero_grad(set_to_none=True)

    def _layers_of(self, piece: nn.Module) -> dict[str, nn.Module]:
        """The piece's own modules of the layers (the tracer keeps each layer a submodule the graph calls)."""
        container = self.split_points[0].rpartition(".")[0] if self.split_points else ""
        try:
            return dict(piece.get_submodule(container).named_children()) if container else {}
        except AttributeError:
            return {}

    def names_per_stage(self, trace: _Trace) -> list[set[str]]:
        """The whole module's names of the parameters and buffers each stage's piece uses."""
        return [{self._prefix + _model_name(n) for n in _used(piece)} for piece in trace.pieces]

    def stages(
        self,
        views: dict[int, nn.Module],
        device: torch.device,
        recompute: Callable[[Mapping[str, nn.Module]], None] | None = None,
    ) -> StageModules:
        """This rank's stage modules for a batch: its pieces of that batch's trace, holding the real tensors.
        ``recompute`` (``lightning_pp.memory.recompute.checkpoint_layers``) is given each piece's layers."""
        built: dict[int, list[StageModule]] = {}

        def make(train: bool, call: ModelCall) -> list[StageModule]:
            trace = self.trace(train, call)
            if id(trace) not in built:
                pieces = {s: _adopt(trace.pieces[s], views[s], self._prefix, device) for s in views}
                if recompute is not None:
                    for piece in pieces.values():
                        recompute(self._layers_of(piece))
                built[id(trace)] = [_TracedStage(pieces[s], s, trace, self.skeleton) for s in views]
            return built[id(trace)]

        return make

    def sharded_stages(
        self,
        views: dict[int, nn.Module],
        device: torch.device,
        recompute: Callable[[Mapping[str, nn.Module]], None] | None = None,
    ) -> tuple[list[StageModule], StageModules]:
        """Under FSDP: one module per stage for every batch signature, holding the stage's view (the FSDP root
        above its units), which runs the signature's piece; and what hands the modules out per batch."""
        roots = [_ShardedTracedStage(views[s], s, self.n_stages, self.skeleton) for s in views]
        built: dict[int, list[tuple[nn.Module, list[_Binding]]]] = {}

        def make(train: bool, call: ModelCall) -> list[StageModule]:
            trace = self.trace(train, call)
            if id(trace) not in built:
                built[id(trace)] = [_adopt(trace.pieces[s], views[s], self._prefix, device, bound=True) for s in views]
                if recompute is not None:
                    for piece, _ in built[id(trace)]:
                        recompute(self._layers_of(piece))
            for root, (piece, bindings) in zip(roots, built[id(trace)]):
                root.use(piece, bindings, trace)
            return roots  # type: ignore[return-value]

        return roots, make  # type: ignore[return-value]


def traced_placement(
    module: nn.Module, layers: str, n_stages: int, balance: Balance, call: ModelCall, train: bool
) -> tuple[Placement, Tracer]:
    """The placement a first trace gives (layers by ``balance``, every other part where the pieces use it),
    and the tracer for later traces; on every rank alike, before any collective."""
    keys = tuple(find_layers(module, layers))
    if not layers.startswith(call.entry):
        raise PipelineConfigError(f"The step calls '{call.entry}', which does not hold the layers at {layers!r}.")
    costs = _layer_costs(module, layers)
    profile = isinstance(balance, str) and balance.lower() == "profile"
    if profile:  # FLOPs of a uniformly split trace's pieces: every layer in some piece
        uniform = tuple(resolve_balance("uniform", len(keys), n_stages))
        costs = Tracer(module, call.entry, layers, uniform).flop_costs(train, call)
    counts = tuple(resolve_balance(balance, len(keys), n_stages, costs))
    if profile:
        rank_zero_info(describe_costs(costs, list(counts), flops=True))
    tracer = Tracer(module, call.entry, layers, counts)
    held = tracer.names_per_stage(tracer.trace(train, call))
    for (key, layer), stage in zip(find_layers(module, layers).items(), stage_of_each_layer(counts)):
        names = {f"{layers}.{key}.{n}" for n, _ in _tensors(layer)}
        if not {s for s in range(n_stages) if names & held[s]} <= {stage}:
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


def _refuse_compiled(model: nn.Module, prefix: str) -> None:
    """The pieces call none of the model's modules: a compile of one of them would run eagerly, unseen."""
    compiled = [prefix + n for n, m in model.named_modules() if is_compiled(m)]
    if compiled:
        raise PipelineConfigError(
            f"{compiled[0]}{f' (and {len(compiled) - 1} more)' if len(compiled) > 1 else ''} was compiled in place"
            " (`.compile()`), which split='trace' cannot keep: each rank's pieces run a trace of the model, not its"
            " modules, so that compile would run eagerly, unseen. Remove those calls and pass"
            " PipelineStrategy(compile=True) (or compile={'backend': ..., 'mode': ...}), which compiles the layers of"
            " each rank's pieces."
        )


def _without_cache(skeleton: nn.Module) -> None:
    """A Hugging Face config's ``use_cache=True`` (most configs' default) would make the traced graph return a
    cache object: the traced copy runs without it, as HF itself does under gradient checkpointing. The user's
    model keeps its config."""
    cached = configs_with(skeleton, "use_cache")
    for config in cached:
        config.use_cache = False
    if cached:
        _say_once(
            f"{type(skeleton).__name__} has config.use_cache=True; the pipeline's traced copy runs with"
            " use_cache=False (a key/value cache is not used in training). Your model's config is unchanged."
        )


def _say_router_loss(skeleton: nn.Module) -> None:
    """A load-balancing loss is a product of per-expert means over the tokens it sees, which does not add up over
    micro-batches: a user comparing against one process on whole batches would otherwise find other losses."""
    if configs_with(skeleton, "output_router_logits"):
        _say_once(
            f"{type(skeleton).__name__} has config.output_router_logits=True: its load-balancing loss is computed"
            " per micro-batch, so the pipeline trains as one process fed the micro-batches and stepping every"
            " n_microbatches of them (accumulate_grad_batches) does, not as one on whole batches (the language-model"
            " loss alone equals the whole batch's)."
        )


def _router_loss_fix(skeleton: nn.Module, reason: str) -> str:
    """What to change when a trace stopped at the load-balancing loss: transformers before 5.23 count each expert's
    tokens with ``torch.bincount``, whose length only the data decides, so a trace on meta cannot run it (5.23 counts
    them with ``histc``). Empty for any other failure."""
    if "bincount" not in reason or not configs_with(skeleton, "output_router_logits"):
        return ""
    import transformers

    return (
        "Its load-balancing loss (config.output_router_logits=True) counts each expert's tokens with torch.bincount"
        f" in transformers {transformers.__version__}: install transformers>=5.23 (it counts them with histc) or set"
        " output_router_logits=False"
    )


@functools.lru_cache(maxsize=None)
def _say_once(message: str) -> None:
    rank_zero_info(message)


def _trace(skeleton: nn.Module, train: bool, call: ModelCall, split_points: list[str], n_stages: int) -> _Trace:
    from torch.distributed.pipelining import SplitPoint, pipeline

    name = type(skeleton).__name__
    if call.kwargs.get("use_cache") is True:
        raise PipelineConfigError(
            f"The step calls {name} with use_cache=True: a key/value cache cannot be traced into pipeline stages"
            " (and training does not use it). Leave use_cache out of the call, or pass use_cache=False."
        )
    args, kwargs = tree_map_only(torch.Tensor, lambda t: t.to("meta"), (call.args, call.kwargs))
    skeleton.train(train)
    specs: list[TreeSpec] = []  # the output's structure, seen as the tracer runs forward (eagerly, on fake tensors)
    hook = skeleton.register_forward_hook(lambda _, __, out: specs.append(tree_flatten(out)[1]))
    try:
        with _tracing_on_meta(), warnings.catch_warnings():
            # torch's pipeline() deep-copies its graph's codegen, which holds a LeafSpec: torch's own deprecation
            warnings.filterwarnings("ignore", message=r"`isinstance\(treespec, LeafSpec\)` is deprecated")
            pipe = pipeline(skeleton, args, kwargs, split_spec={p: SplitPoint.BEGINNING for p in split_points})
        out_spec = specs[-1]
        pieces = [pipe.split_gm.get_submodule(f"submod_pp_{i}") for i in range(pipe.num_stages)]
        if len(pieces) != n_stages:
            raise PipelineConfigError(f"the tracer made {len(pieces)} pieces, not {n_stages}")
        _check_made_by_forward(skeleton, pieces)
        trace = _Trace(pieces, *_wiring(pipe.split_gm.graph), out_spec)
        bound = _bind(skeleton, args, kwargs)
        received: tuple = ()
        for stage in range(n_stages):  # once on meta: torch's split can miswire a graph (see _OnMeta)
            values = trace.run(stage, received, bound)
            received = tuple(values[key] for key in (trace.carry + [trace.outputs])[stage])
    except PipelineConfigError:
        raise
    except Exception as error:
        cause, inner = error, error.__cause__
        while inner is not None:  # torch wraps the tracer's own error in a generic one
            cause = inner if str(inner).strip() else cause  # type: ignore[assignment]
            inner = inner.__cause__
        reason = (str(cause).strip().splitlines() or [""])[0]
        fix = eager_experts_fix(skeleton) or untraced_adapters_fix(skeleton) or _router_loss_fix(skeleton, reason)
        raise PipelineConfigError(
            f"split='trace' cannot trace and split {name} with torch.distributed.pipelining ({type(cause).__name__}:"
            f" {reason}). {fix + ', which trace, or use' if fix else 'Use'} {_ALTERNATIVES}."
        ) from error
    finally:
        hook.remove()
        for point in split_points:  # pipeline() wraps the split modules' forward
            skeleton.get_submodule(point).__dict__.pop("forward", None)
    return trace


def _wiring(graph: fx.Graph) -> tuple[list[list[tuple[str, Any]]], list[list[_Key]], list[_Key]]:
    """From the tracer's root graph: each piece's inputs, what each stage sends on, the output's leaves."""
    stage_of = {n: i for i, n in enumerate(n for n in graph.nodes if n.op == "call_module")}

    def source(node: fx.Node) -> tuple[str, Any]:
        if node.op == "placeholder":
            return ("root", node.target)
        producer, index = (node.args[0], node.args[1]) if node.target is operator.getitem else (node, 0)
        return ("act", (stage_of[producer], index))  # type: ignore[index]

    sources = [[source(a) for a in node.args] for node in stage_of]  # type: ignore[arg-type]
    (result,) = (n for n in graph.nodes if n.op == "output")
    leaves = result.args[0] if isinstance(result.args[0], (tuple, list)) else (result.args[0],)
    outputs = [source(leaf)[1] for leaf in leaves]  # type: ignore[arg-type]
    n = len(stage_of)
    # a value crosses boundary b when a piece after it (or the output, "piece n") uses a value made up to b
    uses = [(consumer, ref) for consumer, wants in enumerate(sources) for kind, ref in wants if kind == "act"]
    uses += [(n, ref) for ref in outputs]
    carry = [sorted({ref for consumer, ref in uses if ref[0] <= b < consumer}) for b in range(n - 1)]
    return sources, carry, outputs


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


def _used(module: nn.Module, prefix: str = "") -> set[str]:
    """Names of the parameters and buffers (and graph constants) that ``module``'s graphs reach."""
    graph = getattr(module, "graph", None)
    if not isinstance(graph, fx.Graph):  # a module the trace kept whole
        return {prefix + n for n, _ in _tensors(module)}
    used: set[str] = set()
    for node in graph.nodes:
        if node.op not in ("call_module", "get_attr"):
            continue
        target = str(node.target)
        path, _, attr = target.rpartition(".")
        obj = getattr(module.get_submodule(path), attr)
        if isinstance(obj, nn.Module):
            used |= _used(obj, prefix + target + ".")
        else:
            used.add(prefix + target)
    return used


def _adopt(piece: nn.Module, view: nn.Module, prefix: str, device: torch.device, bound: bool = False) -> Any:
    """``piece`` holding the view's real tensors under the same names, and running on ``device`` (with
    ``bound``, also where each of the view's tensors sits in it, to be bound again later).

    A tensor the piece's graphs never use (the tracer leaves the first piece a stray reference to a tied
    weight) is dropped, so that no meta tensor remains among the stage's parameters.
    """
    bindings: list[_Binding] = []
    used = _used(piece)
    for name, tensor in list(_tensors(piece)):
        *path, attr = name.split(".")
        owner = piece.get_submodule(".".join(path))
        slots = owner._parameters if attr in owner._parameters else owner._buffers
        if name not in used:
            del slots[attr]
        elif _holds(view, own := prefix + _model_name(name)):
            slots[attr] = get_path(view, own)
            bindings.append((slots, attr, own))
        else:  # a number forward made into a tensor (see _OnMeta)
            slots[attr] = tensor.to(device)
    for sub in list(piece.modules()):
        graph = getattr(sub, "graph", None)
        if isinstance(graph, fx.Graph):
            for node in list(graph.nodes):
                if node.target is torch.ops.aten._assert_tensor_metadata.default:
                    # the dtype the trace saw: under autocast (bf16-mixed) activations are half, and the
                    # conversions that follow (HF's logits.float()) must run, not fail
                    graph.erase_node(node)
                    continue
                node.args = map_aggregate(node.args, lambda v: _device(v, device))
                node.kwargs = map_aggregate(node.kwargs, lambda v: _device(v, device))
                if node.name == "self" and node.op != "placeholder":  # a call of a submodule named so (BERT's
                    node._rename("self_")  # attention.self): as a variable of the code it would shadow the module
                if node.target is torch.ops.aten.histc.default and device.type in _NO_INTEGER_HISTC:
                    _count_in_float(graph, node)
                elif node.target is EXPERTS_OP:
                    call_eager(sub, node, view)
            if isinstance(sub, fx.GraphModule):
                sub.recompile()
            elif getattr(sub, "graph_module", None) is not None:  # an InterpreterModule: its code, which dynamo
                sub.finalize()  # traces (it cannot trace fx's Interpreter), generated again from the edited graph
                sub._run_with_interpreter = False  # and run: fx's Interpreter, node by node, took a stage 1.8x as long
    return (piece, bindings) if bound else piece


class _OnMeta(TorchFunctionMode):
    """What a trace on the meta skeleton must record as eager code runs it on a real device.

    * A number forward makes into a tensor (``torch.tensor(torch.finfo(x.dtype).min, device=x.device)``,
      HF GPT-Neo's attention) is made on the CPU: on meta, the tracer would lift a constant whose value is
      lost. A 0-dim CPU tensor mixes with tensors of any device as a number does; so do the lists of integers
      an index holds (HF Falcon's ``qkv[:, :, :, [-2]]``), as CPU index tensors.
    * ``torch.no_grad()`` regions become detached results (``regions``, kept by :func:`_tracing_on_meta`):
      torch 2.13's tracer records a grad-mode switch as a higher-order op, and unflattening then drops the
      arguments of a submodule called inside one (HF's rotary embeddings, ``@torch.no_grad()`` on their
      ``forward``: Llama, Qwen2, Mistral, Phi). Same values, the same gradients blocked.
    """

    def __init__(self) -> None:
        super().__init__()
        self.regions: list[bool] = []  # innermost last: True in no_grad, False in enable_grad

    def __torch_function__(self, func, types, args=(), kwargs=None):  # type: ignore[no-untyped-def]
        kwargs = kwargs or {}
        number = bool(args) and isinstance(args[0], (bool, int, float))
        if func in _FROM_VALUES and number and torch.device(kwargs.get("device") or "cpu").type == "meta":
            kwargs = {**kwargs, "device": "cpu"}
        elif func is torch.Tensor.__getitem__ and len(args) == 2:
            args = (args[0], _listed_indices_on_cpu(args[1]))
        out = func(*args, **kwargs)
        if self.regions and self.regions[-1]:
            out = tree_map_only(torch.Tensor, lambda t: t.detach() if t.requires_grad else t, out)
        return out


_FROM_VALUES = (torch.tensor, torch.as_tensor, torch.scalar_tensor)


def _listed_indices_on_cpu(index: Any) -> Any:
    """An index's lists of integers (``qkv[:, :, :, [-2]]``, HF Falcon's attention) as CPU tensors: indexing makes
    them tensors on the indexed tensor's device, on meta without their values. The same indexing."""

    def on_cpu(i: Any) -> Any:
        listed = isinstance(i, list) and bool(i) and all(isinstance(n, int) and not isinstance(n, bool) for n in i)
        return torch.tensor(i, device="cpu") if listed else i

    return tuple(map(on_cpu, index)) if isinstance(index, tuple) else on_cpu(index)


@contextlib.contextmanager
def _tracing_on_meta() -> Iterator[None]:
    """:class:`_OnMeta` active, with ``torch.no_grad``/``torch.enable_grad`` marking regions instead of
    switching grad mode."""
    mode = _OnMeta()
    saved = {cls: (cls.__enter__, cls.__exit__) for cls in (torch.no_grad, torch.enable_grad)}

    def entering(detach: bool) -> Callable[[Any], None]:
        return lambda _: mode.regions.append(detach)

    def leave(*_: Any) -> None:  # None: an exception inside the region propagates
        mode.regions.pop()

    for cls, detach in ((torch.no_grad, True), (torch.enable_grad, False)):
        cls.__enter__, cls.__exit__ = entering(detach), leave  # type: ignore[method-assign,assignment]
    try:
        with mode:
            yield
    finally:
        for cls, (enter, exit_) in saved.items():
            cls.__enter__, cls.__exit__ = enter, exit_  # type: ignore[method-assign]


def _check_made_by_forward(skeleton: nn.Module, pieces: list[nn.Module]) -> None:
    """Refuse tensors other than numbers that forward creates from values (``torch.tensor([...])``).

    The tracer lifts them into the pieces as constants (``lifted_tensor_0``), but on the meta skeleton
    their values were never computed, and the model holds nothing of that name to adopt.
    """
    made = sorted(
        name
        for piece in pieces
        for name in _used(piece)
        if not _holds(skeleton, _model_name(name)) and get_path(piece, name).is_meta
    )
    if made:
        raise PipelineConfigError(
            f"{type(skeleton).__name__}'s forward creates tensors from values ({', '.join(made)}: for example"
            " `torch.tensor([...], device=x.device)`), which a trace on the meta device records without their"
            " values. Compute them in __init__ and register them as buffers (`self.register_buffer(name, tensor,"
            f" persistent=False)`), or use {_ALTERNATIVES}."
        )


def _model_name(name: str) -> str:
    """The module's own name of a piece's tensor: the tracer names a module's second call ``rotary_emb@1`` (HF
    Olmo3 calls its rotary embedding once per layer type), which holds the same tensors as the first."""
    return re.sub(r"@\d+(?=\.|$)", "", name)


def _holds(module: nn.Module, name: str) -> bool:
    try:
        get_path(module, name)
    except AttributeError:
        return False
    return True


_NO_INTEGER_HISTC = ("cpu", "mps")


def _count_in_float(graph: fx.Graph, histc: fx.Node) -> None:
    """Counts in float what the trace recorded counting in integers.

    Code that branches on its device records, on meta, the branch of an accelerator: transformers' MoE experts
    (``grouped_mm``) and load-balancing loss count tokens per expert with ``torch.histc`` of ``.int()`` ids
    there and of ``.float()`` ids on the CPU, which has no integer histogram. The same counts, as the CPU
    branch computes them.
    """
    with graph.inserting_before(histc):
        ids = graph.call_function(torch.ops.aten._to_copy.default, (histc.args[0],), {"dtype": torch.float32})
    histc.args = (ids, *histc.args[1:])


def _device(value: Any, device: torch.device) -> Any:
    return device if isinstance(value, torch.device) and value.type == "meta" else value


class _TracedStage(StageModule):
    """One traced piece: the previous stage's outputs and the call's own inputs in, the model's output out."""

    def __init__(self, piece: nn.Module, index: int, trace: _Trace, model: nn.Module) -> None:
        super().__init__(is_last=index == len(trace.pieces) - 1)
        self.piece = piece
        self._model = [model]  # for its forward's signature (a list: not a submodule)
        self.stage, self._trace = index, trace

    def forward(self, *received: torch.Tensor, mb: torch.Tensor) -> Any:
        return self._run(self.piece, received, mb)

    def _run(self, piece: nn.Module, received: tuple, mb: torch.Tensor) -> Any:
        index, (_, args, kwargs) = self.call_of(mb)
        trace = self._trace
        bound = _bind(self._model[0], args, kwargs) if any(k == "root" for k, _ in trace.sources[self.stage]) else {}
        values = trace.run(self.stage, self.receive(received), bound, piece)
        if self.is_last:
            return self.keep_output(index, tree_unflatten([values[k] for k in trace.outputs], trace.out_spec))
        return tuple(sendable(values[key]) for key in trace.carry[self.stage])


class _ShardedTracedStage(_TracedStage):
    """``split="trace"`` under FSDP: the stage's FSDP root, the same module for every batch signature.

    The traced piece calls none of the user's modules, so their FSDP units never run the hook that gathers
    their parameters: the root gathers every unit before the piece runs and binds the piece to the gathered
    tensors. Gradients land on those; torch's stage reduce-scatters them at the end of the step, as it does
    for a pruned stage (``perform_reduce_grad``). The piece is not a submodule: its tensors are the view's.
    """

    def __init__(self, view: nn.Module, index: int, n_stages: int, model: nn.Module) -> None:
        StageModule.__init__(self, is_last=index == n_stages - 1)
        self.view = view
        self._model = [model]
        self.stage = index
        self._piece: list[tuple[nn.Module, list[_Binding]]] = []
        self._units: list[nn.Module] = []  # the view's FSDP units, found at the first call (sharded by then)

    def use(self, piece: nn.Module, bindings: list[_Binding], trace: _Trace) -> None:
        self._piece[:] = [(piece, bindings)]
        self._trace = trace

    def forward(self, *received: torch.Tensor, mb: torch.Tensor) -> Any:
        from torch.distributed.fsdp import FSDPModule

        self._units = self._units or [m for m in self.view.modules() if isinstance(m, FSDPModule)]
        for unit in self._units:
            unit.unshard()  # a no-op for a unit already gathered in this step
        piece, bindings = self._piece[0]
        for slots, attr, name in bindings:
            slots[attr] = get_path(self.view, name)
        return self._run(piece, received, mb)
