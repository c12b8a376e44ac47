"""Turn a whole LightningModule into the one pipeline stage a rank owns.

The seed convention: a stage keeps its run of the container's layers; every other part becomes
``None`` and the user's ``forward`` skips it. Which parts come before, between or after the
layers is learned by watching one real forward, not guessed from attribute order.
"""

from __future__ import annotations

import contextlib
import contextvars
import dataclasses
import functools
import sys
from collections.abc import Callable, Iterable, Iterator, Sequence
from dataclasses import dataclass, field
from typing import Any

import torch
from torch import nn
from torch.overrides import TorchFunctionMode
from torch.utils._pytree import tree_flatten

from lightning_pp.errors import PipelineConfigError
from lightning_pp.layout.options import Balance
from lightning_pp.split.derive import derive
from lightning_pp.split.partition import Costs, resolve_balance, stage_of_each_layer

Layers = dict[str, nn.Module]
_CONTAINERS = (nn.ModuleDict, nn.ModuleList, nn.Sequential)


def find_layers(module: nn.Module, path: str) -> Layers:
    """The layers of the container at the dotted ``path``, by key: the container's own mapping.

    Deleting a key from it prunes the container and keeps every other layer under its original key
    (an ``nn.ModuleList``'s ``h.5`` stays ``h.5``, so state-dict names never change), and the user's
    ``for block in self.h`` then runs only the stage's layers. ``del h[i]`` would renumber instead.
    """
    obj: Any = module
    walked: list[str] = []
    for name in path.split("."):
        walked.append(name)
        if not hasattr(obj, name):
            found = [n for n, m in module.named_modules() if isinstance(m, _CONTAINERS) and len(m) > 1]
            raise PipelineConfigError(
                f"layers={path!r}: {type(module).__name__} has no attribute {'.'.join(walked)!r}. Pass the dotted"
                " path of the nn.ModuleList, nn.Sequential or nn.ModuleDict that holds the repeated layers, e.g."
                f" PipelineStrategy(layers={(found or ['model.layers'])[0]!r}); such containers in this module:"
                f" {found}."
            )
        obj = getattr(obj, name)
    if isinstance(obj, _CONTAINERS):
        return obj._modules  # type: ignore[return-value]
    if isinstance(getattr(obj, "_orig_mod", None), _CONTAINERS):  # torch.compile(container)
        raise PipelineConfigError(
            f"layers={path!r} is torch.compile's wrapper of the layer container: a pipeline runs the container's"
            " layers in pieces, never the container as one. Leave the container as it is and pass"
            " PipelineStrategy(compile=True), which compiles each layer of each rank's stages (or compile each"
            " layer yourself: `for layer in container: layer.compile()`)."
        )
    raise PipelineConfigError(
        f"layers={path!r} is a {type(obj).__name__}, not an nn.ModuleList, nn.Sequential or nn.ModuleDict of the"
        " repeated layers; pass the path of the container whose entries forward runs one after another."
    )


def is_compiled(module: nn.Module) -> bool:
    """``module.compile()`` was called: its calls run through dynamo (``nn.Module.compile`` keeps it in place)."""
    return getattr(module, "_compiled_call_impl", None) is not None


def resolve_layers(module: nn.Module, path: str | None) -> str:
    """``path`` as the module's own qualified name of its layer container: a wrapper such as peft's puts steps
    into the names (``model.base_model.model.model.layers`` for ``self.model = get_peft_model(llama, config)``)
    that a user need not spell. Every name built from the path (parts, stages, state-dict keys) must be the
    qualified one, so the path is resolved once and only the result is used.

    ``None``: the container of the repeated layers (``repeated_layers``). Else the path itself, if it is a
    qualified name; else the one container whose name has the path's parts in order with only wrapper steps
    (steps out of a peft model or tuner) left out, or that the path reaches as attributes (peft forwards them);
    none or several: a PipelineConfigError naming them.
    """
    if path is None:
        return repeated_layers(module)
    modules = {name: m for name, m in module.named_modules() if m is not None}
    if path in modules:
        return path
    try:
        reached = get_path(module, path)
    except AttributeError:
        reached = None
    found = [
        n
        for n, m in modules.items()
        if isinstance(m, _CONTAINERS) and (m is reached or _through_wrappers(n, path, modules))
    ]
    if len(found) > 1:
        raise PipelineConfigError(
            f"layers={path!r} matches several layer containers through wrappers: {found}. Pass one of these"
            " qualified names as layers=."
        )
    if not found:
        find_layers(module, path)  # raises, naming the containers there are
        return path
    return found[0]


def repeated_layers(module: nn.Module) -> str:
    """The qualified name of the container of the model's repeated layers, for a module given no ``layers=``: of
    the containers whose children with parameters (two or more) are all of one type (a transformer's blocks, an
    MLP's ``nn.Linear``s in an ``nn.Sequential``) and that no such container holds (a block's experts), the one
    holding the most parameters; with none, the same of the containers of mixed children (a CNN's
    ``nn.Sequential`` of convolutions, norms and a head). Two holding alike (an encoder's and a decoder's blocks:
    the other's would all sit on one stage) are refused, naming both."""
    for uniform in (True, False):
        sizes = _outermost_containers(module, uniform)
        ranked = sorted(sizes, key=sizes.__getitem__, reverse=True)
        if len(ranked) > 1 and 2 * sizes[ranked[1]] >= sizes[ranked[0]]:
            alike = " and ".join(f"{n!r} ({sizes[n]:,} parameters)" for n in ranked[:2])
            raise PipelineConfigError(
                f"{type(module).__name__} holds two containers of layers of about one size, {alike}; the pipeline"
                " splits one and keeps the other whole on one stage. Pass the one to split as"
                " PipelineStrategy(layers=...)."
            )
        if ranked:
            return ranked[0]
    raise PipelineConfigError(
        f"{type(module).__name__} holds no nn.ModuleList, nn.Sequential or nn.ModuleDict of two or more layers with"
        " parameters to split into stages. Put the layers in one and pass its dotted path as"
        " PipelineStrategy(layers=...)."
    )


def _outermost_containers(module: nn.Module, uniform: bool) -> dict[str, int]:
    """Parameters held by each container of two or more children with parameters (all of one type where
    ``uniform``) that no other such container holds."""
    sizes: dict[str, int] = {}
    for name, m in module.named_modules():
        typed = [type(c) for c in m.children() if _holds_parameters(c)]
        if isinstance(m, _CONTAINERS) and len(typed) > 1 and (len(set(typed)) == 1 or not uniform):
            if not any(name.startswith(outer + ".") for outer in sizes):
                sizes[name] = sum(p.numel() for p in m.parameters())
    return sizes


def _holds_parameters(module: nn.Module) -> bool:
    return next(module.parameters(), None) is not None


def resolution_note(module: nn.Module, given: str | None, resolved: str) -> str:
    """What ``resolve_layers`` made of a path that was not the qualified name (or of none), to be said once."""
    modules = dict(module.named_modules())
    if given is None:
        layers = list(modules[resolved].children())
        share = sum(p.numel() for p in modules[resolved].parameters()) / sum(p.numel() for p in module.parameters())
        return (
            f"Splitting {resolved!r} into stages: {len(layers)} layers ({type(layers[-1]).__name__}) holding"
            f" {share:.0%} of the parameters; pass layers= to split another container"
        )
    steps = resolved.split(".")
    inside = any(_is_wrapper(modules[".".join(steps[:i])]) for i in range(len(steps)))
    return f"layers={given!r} resolved to {resolved!r}" + (" (inside a peft model)" if inside else "")


def _through_wrappers(name: str, path: str, modules: dict[str, nn.Module]) -> bool:
    """Whether ``path``'s parts are ``name``'s in order, with only steps out of a wrapper between them."""
    steps = name.split(".")
    wrapper = [_is_wrapper(modules[".".join(steps[:i])]) for i in range(len(steps))]
    wanted = path.split(".")

    @functools.cache
    def match(i: int, j: int) -> bool:
        if i == len(steps):
            return j == len(wanted)
        return (j < len(wanted) and steps[i] == wanted[j] and match(i + 1, j + 1)) or (wrapper[i] and match(i + 1, j))

    return match(0, 0)


def _is_wrapper(module: nn.Module) -> bool:
    """A peft model or tuner: it holds the model it adapts one step down and forwards attributes to it. peft is
    not imported here: a module that holds one has imported it."""
    peft = sys.modules.get("peft")
    if peft is None:
        return False
    from peft.tuners.tuners_utils import BaseTuner

    return isinstance(module, (peft.PeftModel, BaseTuner))


@dataclass(frozen=True)
class Tie:
    """One Parameter that more than one stage holds: a tied embedding and head, a part or loose parameter used
    on several stages. ``names`` are all its names in the whole module, ``holders[i]`` the stages of
    ``names[i]``."""

    names: tuple[str, ...]
    holders: tuple[tuple[int, ...], ...]

    @property
    def stages(self) -> tuple[int, ...]:
        return tuple(sorted({s for stages in self.holders for s in stages}))

    @property
    def source(self) -> int:
        """The stage whose value one process ends with: it holds the first module (in ``named_modules`` order)
        that owns the tensor, whose initialiser runs last."""
        return self.holders[0][0]

    def names_on(self, stage: int) -> list[str]:
        return [n for n, stages in zip(self.names, self.holders) if stage in stages]


@dataclass(frozen=True)
class Placement:
    """Where every part of the module lives; the same on every rank."""

    layers_path: str
    layer_keys: tuple[str, ...]
    counts: tuple[int, ...]
    # dotted name of each non-layer child module / loose parameter -> stages that keep it
    parts: dict[str, tuple[int, ...]] = field(default_factory=dict)
    params: dict[str, tuple[int, ...]] = field(default_factory=dict)
    ties: tuple[Tie, ...] = ()

    @property
    def n_stages(self) -> int:
        return len(self.counts)

    def layers_of(self, stage: int) -> list[str]:
        stages = stage_of_each_layer(self.counts)
        return [k for k, s in zip(self.layer_keys, stages) if s == stage]

    def absent_on(self, *stages: int) -> list[str]:
        """Parts and loose parameters that are None on a rank holding ``stages``."""
        return [n for n, st in {**self.parts, **self.params}.items() if not set(stages) & set(st)]

    def describe(self, module: nn.Module) -> str:
        """A table of what each stage holds, for the placement log."""
        lines = [f"Pipeline placement ({self.n_stages} stages, layers at '{self.layers_path}'):"]
        layers = find_layers(module, self.layers_path)
        for s in range(self.n_stages):
            keys = self.layers_of(s)
            parts = [n for n, st in {**self.parts, **self.params}.items() if s in st]
            n_params = sum(p.numel() for k in keys for p in layers[k].parameters())
            for name in parts:
                obj = get_path(module, name)
                n_params += obj.numel() if isinstance(obj, nn.Parameter) else sum(p.numel() for p in obj.parameters())
            span = f"{keys[0]}..{keys[-1]}" if len(keys) > 1 else keys[0]
            lines.append(f"  stage {s}: layers {span} ({len(keys)}), parts {parts or '-'}, {n_params:,} parameters")
        for tie in self.ties:
            lines.append(f"  shared by stages {list(tie.stages)} (gradients summed): {' = '.join(tie.names)}")
        return "\n".join(lines)


@dataclass
class _Trace:
    layer_order: list[str] = field(default_factory=list)
    # name -> positions, where a position counts the layers started before the use
    uses: dict[str, list[int]] = field(default_factory=dict)


def _containers(module: nn.Module, path: str) -> list[tuple[str, nn.Module]]:
    """The modules on the way from the root to the layers' parent, with their dotted prefixes."""
    out = [("", module)]
    obj = module
    names = path.split(".")[:-1]
    for i, name in enumerate(names):
        obj = getattr(obj, name)
        out.append((".".join(names[: i + 1]) + ".", obj))
    return out


def model_entries(module: nn.Module, path: str) -> dict[str, nn.Module]:
    """The modules a step may call as "the model": the root, each container on the way to the layers, and the
    layers' own container.

    A LightningModule often wraps the network (``self.model = GPT()``) and its step calls either
    ``self(x)`` or ``self.model(x)``; both run the layers. A network that is one ``nn.Sequential``
    (``self.net(x)``) is its own layers: a stage runs its pruned part.
    """
    entries = {prefix.rstrip("."): container for prefix, container in _containers(module, path)}
    return {**entries, path: get_path(module, path)}


def parts_and_params(module: nn.Module, path: str) -> tuple[dict[str, nn.Module], dict[str, nn.Parameter]]:
    """Child modules and loose parameters beside the layers (on the root or on the path to them)."""
    on_path = {".".join(path.split(".")[: i + 1]) for i in range(len(path.split(".")))}
    parts: dict[str, nn.Module] = {}
    params: dict[str, nn.Parameter] = {}
    for prefix, container in _containers(module, path):
        for name, child in container.named_children():
            if prefix + name not in on_path:
                parts[prefix + name] = child
        for name, p in container.named_parameters(recurse=False):
            params[prefix + name] = p
    return parts, params


class _ParamUse(TorchFunctionMode):
    """Notes the position at which loose (non-module) parameters enter an operation."""

    def __init__(self, params: dict[str, nn.Parameter], trace: _Trace) -> None:
        super().__init__()
        self._by_id = {id(p): n for n, p in params.items()}
        self._trace = trace

    def __torch_function__(self, func, types, args=(), kwargs=None):  # type: ignore[no-untyped-def]
        for leaf in tree_flatten((args, kwargs or {}))[0]:
            name = self._by_id.get(id(leaf))
            if name is not None:
                self._trace.uses.setdefault(name, []).append(len(self._trace.layer_order))
        return func(*args, **(kwargs or {}))


def trace_forward(module: nn.Module, path: str, run_forward: Callable[[], Any]) -> _Trace:
    """Run one real forward and record when each layer, part and loose parameter is used."""
    layers = find_layers(module, path)
    parts, params = parts_and_params(module, path)
    trace = _Trace()
    handles = []

    def on_layer(key: str) -> Callable[..., None]:
        def hook(*_: Any) -> None:
            trace.layer_order.append(key)

        return hook

    def on_part(name: str) -> Callable[..., None]:
        def hook(*_: Any) -> None:
            trace.uses.setdefault(name, []).append(len(trace.layer_order))

        return hook

    for key, layer in layers.items():
        handles.append(layer.register_forward_pre_hook(on_layer(key)))
    for name, part in parts.items():
        handles.append(part.register_forward_pre_hook(on_part(name)))
    try:
        with torch.no_grad(), _ParamUse(params, trace):
            run_forward()
    finally:
        for h in handles:
            h.remove()
    return trace


def plan_placement(
    module: nn.Module, path: str, n_stages: int, balance: Balance, trace: _Trace, profiled: Costs | None = None
) -> Placement:
    """Decide every part's stage from the traced forward; reject what cannot be pipelined.

    ``profiled`` are the measured costs ``balance="profile"`` splits by (given only in that mode).
    """
    layers = find_layers(module, path)
    keys = tuple(layers.keys())
    if not keys:
        raise PipelineConfigError(f"layers={path!r} is empty; the pipeline splits its layers.")
    order = trace.layer_order
    if order != list(keys):
        if not order:
            raise PipelineConfigError(
                f"forward never called the layers at {path!r}; pass the attribute that forward iterates"
                " over with PipelineStrategy(layers=...)."
            )
        raise PipelineConfigError(
            f"forward called the layers at {path!r} in the order {order}, but a pipeline runs them once each"
            f" in the container's order {list(keys)}; reorder the container or the loop in forward."
        )
    parts, params = parts_and_params(module, path)
    n = len(keys)

    # cost model for balance="parameters": parts before the layers count on the first stage, after on
    # the last, in between with the layer they follow
    layer_costs = [sum(p.numel() for p in layers[k].parameters()) for k in keys]
    first = last = 0
    sizes = {name: sum(p.numel() for p in part.parameters()) for name, part in parts.items()}
    sizes.update({name: p.numel() for name, p in params.items()})
    for name, size in sizes.items():
        positions = trace.uses.get(name, [n])
        pos = positions[0]
        if pos == 0:
            first += size
        elif pos >= n:
            last += size
        else:
            layer_costs[pos - 1] += size
    by_params = Costs([float(c) for c in layer_costs], float(first), float(last))
    counts = resolve_balance(balance, n, n_stages, profiled if profiled is not None else by_params)
    layer_stage = stage_of_each_layer(counts)

    def stages_at(positions: list[int]) -> tuple[int, ...]:
        return tuple(sorted({0 if pos == 0 else layer_stage[min(pos, n) - 1] for pos in positions}))

    placed_parts: dict[str, tuple[int, ...]] = {}
    for name, part in parts.items():
        if name in trace.uses:
            placed_parts[name] = stages_at(trace.uses[name])
        else:
            # never called by forward (loss modules, metrics): with parameters on the last stage, where the
            # step runs; without, on every stage, so that metrics mirrored from the last stage exist everywhere
            has_params = any(True for _ in part.parameters())
            placed_parts[name] = (n_stages - 1,) if has_params else tuple(range(n_stages))
    placed_params = {name: stages_at(trace.uses[name]) if name in trace.uses else (n_stages - 1,) for name in params}
    placement = Placement(path, keys, tuple(counts), placed_parts, placed_params)
    return dataclasses.replace(placement, ties=find_ties(module, placement))


def find_ties(module: nn.Module, placement: Placement) -> tuple[Tie, ...]:
    """Every Parameter held by more than one stage, in the module's parameter order."""
    by_id: dict[int, list[str]] = {}
    for name, p in module.named_parameters(remove_duplicate=False):
        by_id.setdefault(id(p), []).append(name)
    ties = []
    for names in by_id.values():
        holders = tuple(_owner_stages(placement, n) for n in names)
        if len({s for stages in holders for s in stages}) > 1:
            ties.append(Tie(tuple(names), holders))
    return tuple(ties)


def _owner_stages(placement: Placement, name: str) -> tuple[int, ...]:
    prefix = placement.layers_path + "."
    if name.startswith(prefix):
        key = name[len(prefix) :].split(".")[0]
        return (stage_of_each_layer(placement.counts)[placement.layer_keys.index(key)],)
    for owner, stages in {**placement.parts, **placement.params}.items():
        if name == owner or name.startswith(owner + "."):
            return stages
    return tuple(range(placement.n_stages))


def prune_to_stages(module: nn.Module, placement: Placement, stages: Sequence[int]) -> None:
    """Drop every layer, part and loose parameter none of ``stages`` owns; names stay unchanged."""
    container = get_path(module, placement.layers_path)
    keep = {key for stage in stages for key in placement.layers_of(stage)}
    for key in list(container._modules):
        if key not in keep:
            del container._modules[key]  # not `del container[i]`, which renumbers a ModuleList
    if isinstance(container, (nn.ModuleList, nn.Sequential)):
        derive(container, _GlobalIndex)
    for name in placement.absent_on(*stages):
        parent, _, attr = name.rpartition(".")
        setattr(get_path(module, parent) if parent else module, attr, None)


def parameterless_parts(module: nn.Module, names: Iterable[str]) -> dict[str, nn.Module]:
    """The modules among ``names`` that hold no parameters (rotary embeddings, dropout): cheap to keep."""
    parts = {name: get_path(module, name) for name in names}
    return {
        name: part
        for name, part in parts.items()
        if isinstance(part, nn.Module) and next(part.parameters(), None) is None
    }


class LayerNotHere(IndexError):
    """A pruned container indexed by a layer's global position on a stage that does not hold that layer."""


class _GlobalIndex:
    """A pruned ModuleList or Sequential: an integer index names a layer's global key. By position it would
    silently pick another layer of this stage (or fail with a misleading message)."""

    _modules: dict[str, nn.Module]

    def __getitem__(self, index: Any) -> Any:
        if not isinstance(index, int):
            return super().__getitem__(index)  # type: ignore[misc]
        if str(index) in self._modules:
            return self._modules[str(index)]
        raise LayerNotHere(
            f"Layer {index} is not on this pipeline stage, which holds layers {list(self._modules)} of this"
            f" {type(self).__name__}. Under the pipeline iterate over the layers (`for block in self.h`) instead of"
            " indexing them by position."
        )


def stage_view(module: nn.Module, placement: Placement, stages: Sequence[int]) -> nn.Module:
    """``stages`` as a pruned view that shares parameters with ``module`` and leaves it whole.

    A rank holding several stages runs each through its own view of its one module; validation or
    testing before any fit uses a view, so that a later ``fit`` still hands ``configure_optimizers``
    the whole module.
    """
    # parts and loose parameters sit on the containers along the layers' path: copy exactly those
    view = _shallow(module)
    parent = view
    for name in placement.layers_path.split("."):
        child = _shallow(parent._modules[name])
        parent._modules[name] = child
        parent = child
    prune_to_stages(view, placement, stages)
    return view


def replace_in_view(view: nn.Module, name: str, param: nn.Parameter) -> None:
    """Put ``param`` at the dotted parameter ``name`` of ``view`` only: the modules on the way are copied
    shallowly, so the rank's module and its other stages' views keep what they had."""
    *path, attr = name.split(".")
    parent = view
    for child in path:
        copy = _shallow(parent._modules[child])  # type: ignore[arg-type]
        parent._modules[child] = copy
        parent = copy
    parent._parameters[attr] = param


def _shallow(module: nn.Module) -> nn.Module:
    copy = object.__new__(type(module))
    copy.__dict__ = dict(module.__dict__)
    for slot in ("_modules", "_parameters", "_buffers"):
        copy.__dict__[slot] = type(module.__dict__[slot])(module.__dict__[slot])
    return copy


_RUNNING: contextvars.ContextVar[bool] = contextvars.ContextVar("lightning_pp_running", default=False)


@contextlib.contextmanager
def running_stages() -> Iterator[None]:
    """Inside the pipeline the pruned model may be called at any depth (``forward`` calling ``self.net``)."""
    token = _RUNNING.set(True)
    try:
        yield
    finally:
        _RUNNING.reset(token)


def guard_forwards(module: nn.Module, placement: Placement, stages: list[int], entries: Iterable[nn.Module]) -> None:
    """After pruning, calling the model outside the pipeline must fail loudly, not compute garbage.

    A pre-hook rather than a replaced ``forward``: the stages' views share it, and inside the pipeline
    a wrapper's ``forward`` still reaches the inner network it delegates to.
    """
    layers = [key for stage in stages for key in placement.layers_of(stage)]
    held = f"stage {stages[0]}" if len(stages) == 1 else f"stages {stages}"
    for entry in entries:
        message = (
            f"This {type(entry).__name__} holds only pipeline {held} of {placement.n_stages} (layers {layers} of"
            f" '{placement.layers_path}'); the other parts are None on this rank. Load a checkpoint into a fresh"
            f" module on one process instead, e.g."
            f" {type(module).__name__}.load_from_checkpoint(trainer.checkpoint_callback.best_model_path)."
        )
        entry.register_forward_pre_hook(functools.partial(_refuse_outside, message))


def _refuse_outside(message: str, *_: Any) -> None:
    if not _RUNNING.get():
        raise RuntimeError(message)


def get_path(module: nn.Module, dotted: str) -> Any:
    """The attribute at a dotted path; the empty path is the module itself."""
    if not dotted:
        return module
    obj: Any = module
    for name in dotted.split("."):
        obj = getattr(obj, name)
    return obj


@contextlib.contextmanager
def patched(obj: Any, **attrs: Any) -> Iterator[None]:
    """Set instance attributes for the duration of the block, then put back what was there."""
    missing = object()
    saved = {name: obj.__dict__.get(name, missing) for name in attrs}
    for name, value in attrs.items():
        setattr(obj, name, value)
    try:
        yield
    finally:
        for name, value in saved.items():
            if value is missing:
                delattr(obj, name)
            else:
                setattr(obj, name, value)


def configs_with(module: nn.Module, flag: str) -> list[Any]:
    """The Hugging Face configs in ``module`` whose ``flag`` is True (``use_cache``, most configs' default: a
    key/value cache; ``output_router_logits``), each once."""
    configs = (getattr(m, "config", None) for m in module.modules())
    return list({id(c): c for c in configs if getattr(c, flag, False) is True}.values())


@contextlib.contextmanager
def without_kv_cache(module: nn.Module) -> Iterator[None]:
    """``module`` run as the pipeline runs it, without a key/value cache (the traced copy's configs say
    ``use_cache=False``): an eager Hugging Face forward in training builds the cache otherwise, whose concatenations
    cost time the pipeline does not spend and join torch's split-backward groups (its weight pass then reran freed
    nodes)."""
    configs = configs_with(module, "use_cache")
    for config in configs:
        config.use_cache = False
    try:
        yield
    finally:
        for config in configs:
            config.use_cache = True
