"""Models larger than one device: build on meta, trace on meta, materialise only a rank's own stage.

Parameters are created on the meta device (no memory) while buffers stay real: a causal mask or a
RoPE table computed in ``__init__`` cannot be recomputed later, and buffers are small. A rank then
materialises the parameters of its own stage directly on its device and initialises them by the
*name rule*: each module that owns meta tensors runs its initialiser under an RNG seeded from the
global seed and the module's qualified name. The initial weights therefore do not depend on the
stage count, the schedule, the stages per rank or the replica count, and one process gets the same
weights with :func:`materialize`.
"""

from __future__ import annotations

import contextlib
import functools
import hashlib
import os
import sys
from collections.abc import Callable, Collection, Iterator
from dataclasses import dataclass
from typing import Any

import torch
from torch import nn
from torch.distributed.tensor import DTensor
from torch.utils._pytree import tree_map_only

from lightning_pp.errors import PipelineConfigError
from lightning_pp.layout.dtensors import whole_parameters
from lightning_pp.layout.options import InitFn

_INIT_METHODS = ("reset_parameters", "_reset_parameters")


@contextlib.contextmanager
def empty_weights() -> Iterator[None]:
    """Build modules with their parameters on the meta device and their buffers real.

    ``trainer.init_module()`` and ``configure_model`` use it under ``PipelineStrategy``; use it
    yourself with :func:`materialize` for a one-process run with the pipeline's initial weights.
    A parameter is allocated on the default device only for the moment it is registered (untouched
    pages for ``torch.empty``), so the whole model never occupies memory.
    """
    register = nn.Module.register_parameter

    def register_on_meta(module: nn.Module, name: str, param: nn.Parameter | None) -> None:
        register(module, name, param)
        # a tensor-parallel plan re-registers existing parameters as DTensors: they stay where they were
        if param is not None and not param.is_meta and not isinstance(param, DTensor):
            attributes = {**param.__dict__, "requires_grad": param.requires_grad}
            module._parameters[name] = type(param)(param.to("meta"), **attributes)

    nn.Module.register_parameter = register_on_meta  # type: ignore[method-assign]
    try:
        yield
    finally:
        nn.Module.register_parameter = register  # type: ignore[method-assign]


def global_seed() -> int:
    """The seed of ``lightning.seed_everything`` (0 if none was set): every rank must agree on it."""
    return int(os.environ.get("PL_GLOBAL_SEED", 0))


def name_seed(seed: int, name: str) -> int:
    """The RNG seed of the module called ``name``: independent of which other modules a rank holds."""
    digest = hashlib.blake2b(f"{seed}/{name}".encode(), digest_size=8).digest()
    return int.from_bytes(digest, "little") & ((1 << 63) - 1)


def has_meta_tensors(module: nn.Module) -> bool:
    return any(t.is_meta for t in _own_tensors(module, recurse=True))


def _own_tensors(module: nn.Module, recurse: bool = False) -> Iterator[torch.Tensor]:
    yield from module.parameters(recurse=recurse)
    yield from (b for b in module.buffers(recurse=recurse) if b is not None)


@dataclass(frozen=True)
class _Rule:
    """How the library that built a module initialises it, learned from the modules around it."""

    pretrained: nn.Module | None = None  # the innermost transformers PreTrainedModel holding it: its _init_weights
    lora: tuple[tuple[str, Any], ...] = ()  # a peft LoRA layer: (adapter, init_lora_weights) for each adapter
    tuner: str = ""  # inside an adapter of this peft tuner layer (qualified name), which initialises it afterwards
    unknown: str = ""  # why its initialisation cannot be known without the base weights


_PLAIN = _Rule()


@dataclass(frozen=True)
class _Owner:
    """A module whose initialiser runs: it owns meta tensors that no checkpoint sets (a LoRA layer: its adapters')."""

    name: str  # qualified, in the whole model
    module: nn.Module
    tensors: tuple[str, ...]  # those tensors, named inside ``module``
    rule: _Rule


def check_initializers(
    module: nn.Module, init_fn: InitFn | None = None, loaded: Collection[str] = frozenset(), prefix: str = ""
) -> None:
    """Every module with meta tensors must have an initialiser, unless ``loaded`` (the qualified names a
    pretrained checkpoint sets) holds all of them; checked on the whole module on every rank."""
    _check_metrics(module)
    if init_fn is None:
        _check_owners(module, _owners(module, prefix, loaded, _rules(module, prefix)))


def _check_owners(module: nn.Module, owners: list[_Owner]) -> None:
    missing = [(o, why) for o in owners if isinstance(why := _initializer(o, None), str)]
    if missing:
        shown = [
            f"'{o.name or '<root>'}' ({type(o.module).__name__}: {sorted(o.tensors)}{'; ' + why if why else ''})"
            for o, why in missing
        ]
        raise PipelineConfigError(
            f"{type(module).__name__} was built on the meta device, but these modules own meta parameters or"
            f" buffers and have no initialiser: {', '.join(shown)}. Give each a `reset_parameters(self)` that"
            " initialises its own tensors, or pass PipelineStrategy(init_fn=fn) where fn(module, name) initialises"
            " any module's own tensors"
            + (
                ", or start the adapters from PipelineStrategy(init_adapter=DIR), a PEFT adapter directory."
                if any(o.rule.unknown for o, _ in missing)
                else "."
            )
        )


def _rules(root: nn.Module, prefix: str = "") -> dict[str, _Rule]:
    """Each module's rule by qualified name (``prefix`` is ``root``'s), as its library starts it eagerly: a
    module inside a transformers model by that model's ``_init_weights`` (what ``from_config`` runs), a peft
    tuner layer's adapters by the layer's own reset (what ``get_peft_model`` runs), the modules of an adapter
    by torch's rule (peft creates them as plain modules). No library imported: every module is plain."""
    pretrained_type = _imported("transformers", "PreTrainedModel")
    tuner_type = _imported("peft.tuners.tuners_utils", "BaseTunerLayer")
    rules: dict[str, _Rule] = {}
    if pretrained_type is None and tuner_type is None:
        return rules

    def visit(name: str, module: nn.Module, pretrained: nn.Module | None, configs: dict, inside: _Rule | None) -> None:
        tuner = inside is None and tuner_type is not None and isinstance(module, tuner_type)
        if inside is not None:
            rule = inside
        elif tuner:
            rule = _tuner_rule(name, module, configs)
        else:
            if pretrained_type is not None and isinstance(module, pretrained_type):
                pretrained = module
            rule = _Rule(pretrained=pretrained)
        rules[name] = rule
        own_configs = getattr(module, "peft_config", None)
        configs = own_configs if isinstance(own_configs, dict) and own_configs else configs
        for key, child in module._modules.items():
            if child is not None:
                adapter = tuner and key in getattr(module, "adapter_layer_names", ())
                below = _Rule(tuner=name, unknown=rule.unknown) if adapter else inside
                visit(_join(name, key), child, pretrained, configs, below)

    visit(prefix, root, None, {}, None)
    return rules


def _tuner_rule(name: str, layer: nn.Module, configs: dict[str, Any]) -> _Rule:
    """A peft LoRA layer resets each adapter by its config's ``init_lora_weights`` (as ``update_layer`` does);
    inits drawn from the base weights (PiSSA, OLoRA, LoftQ, ...), variants (DoRA) and other tuners cannot be
    known on meta."""
    lora_type = _imported("peft.tuners.lora.layer", "LoraLayer")
    if lora_type is None or not isinstance(layer, lora_type):
        return _Rule(
            unknown=f"inside peft's {type(layer).__name__} layer '{name}': lightning-pp starts LoRA layers only"
        )
    adapters = []
    for adapter in getattr(layer, "r", {}):
        init = getattr(configs.get(adapter), "init_lora_weights", None)
        variant = getattr(layer, "lora_variant", {}).get(adapter)
        where = f"peft's LoRA layer '{name}' (adapter {adapter!r})"
        if variant is not None:
            return _Rule(unknown=f"{where} is a {type(variant).__name__}, started from the base weights")
        if not (init is True or init is False or (isinstance(init, str) and init.lower() == "gaussian")):
            return _Rule(unknown=f"{where} starts with init_lora_weights={init!r}; on meta: True, False or 'gaussian'")
        adapters.append((adapter, init))
    return _Rule(lora=tuple(adapters))


def _imported(module: str, name: str) -> Any:
    """A library's class, if the library is imported already (a model built with it imports it)."""
    return getattr(sys.modules.get(module), name, None)


def _join(prefix: str, name: str) -> str:
    return f"{prefix}.{name}" if prefix and name else name or prefix


def _owners(module: nn.Module, prefix: str, loaded: Collection[str], rules: dict[str, _Rule]) -> list[_Owner]:
    """The modules (qualified names) whose initialiser runs, every module after all of its descendants.

    Children first, as in eager construction: a parent's initialiser may adjust its children's tensors
    (``nn.MultiheadAttention`` zeroes ``out_proj.bias`` after the Linear's own init, a LoRA layer resets its
    adapters' Linears). A module runs it when it owns a meta tensor that no checkpoint sets (``loaded``); a
    LoRA layer, when one of its adapters' tensors is such.
    """
    owners = []
    for name, m in reversed(list(module.named_modules())):
        qualified = _join(prefix, name)
        rule = rules.get(qualified, _PLAIN)
        named = _adapter_tensors(m) if rule.lora else _named_own(m)
        tensors = tuple(n for n, t in named if t.is_meta and _join(qualified, n) not in loaded)
        if tensors:
            owners.append(_Owner(qualified, m, tensors, rule))
    return owners


def _adapter_tensors(layer: nn.Module) -> Iterator[tuple[str, torch.Tensor]]:
    """A peft tuner layer's adapter tensors (``lora_A.default.weight``), not its base layer's."""
    names = getattr(layer, "adapter_layer_names", ())
    yield from ((n, t) for n, t in _named_all(layer) if n.split(".")[0] in names)


def _named_all(module: nn.Module) -> Iterator[tuple[str, torch.Tensor]]:
    yield from module.named_parameters()
    yield from ((n, b) for n, b in module.named_buffers() if b is not None)


def _initializer(owner: _Owner, init_fn: InitFn | None) -> Callable[[], Any] | str:
    """The call that initialises ``owner``'s tensors under its name's seed, or why none is known ("": none at all).

    ``init_fn`` comes first; then the library's rule; then the module's own ``reset_parameters``. A module inside
    a transformers model runs its own initialiser, then the model's ``_init_weights`` (eager construction's order:
    a module that ``_init_weights`` does not know keeps torch's values).
    """
    if init_fn is not None:
        return functools.partial(init_fn, owner.module, owner.name)
    rule = owner.rule
    if rule.unknown:
        return rule.unknown
    if rule.lora:
        pending = {n.split(".")[1] for n in owner.tensors}  # the adapters some checkpoint does not set
        return functools.partial(_reset_lora, owner.module, [(a, init) for a, init in rule.lora if a in pending])
    own = next((getattr(owner.module, m) for m in _INIT_METHODS if callable(getattr(owner.module, m, None))), None)
    if rule.pretrained is not None:
        return functools.partial(_init_hf, rule.pretrained, owner.module, own)
    if own is not None:
        return own
    if rule.tuner:  # an adapter's tensors outside a Linear (lora_embedding_A): its LoRA layer sets them
        return lambda: None
    return ""


def _reset_lora(layer: Any, adapters: list[tuple[str, Any]]) -> None:
    for adapter, init in adapters:
        layer.reset_lora_parameters(adapter, init)


def _init_hf(model: Any, module: nn.Module, own: Callable[[], Any] | None) -> None:
    if own is not None:
        own()
    model._init_weights(module)


def _library_set(owners: list[_Owner]) -> list[_Owner]:
    """The owners a library's initialiser sets by type (``_init_weights``, a LoRA layer's reset): checked after."""
    return [o for o in owners if o.rule.pretrained is not None or o.rule.tuner]


def _unset(owners: list[_Owner], fill: bool) -> list[tuple[_Owner, list[str]]]:
    """Fill the owners' floating tensors with NaN (``fill``), or list those some NaN is still in."""
    left = []
    for owner in owners:
        tensors = [(n, _tensor(owner.module, n)) for n in owner.tensors]
        floating = [(n, t) for n, t in tensors if t.is_floating_point()]
        if fill:
            for _, t in floating:
                t.fill_(float("nan"))
        elif unset := [n for n, t in floating if bool(t.isnan().any())]:
            left.append((owner, unset))
    return left


def _tensor(module: nn.Module, name: str) -> torch.Tensor:
    path, _, attr = name.rpartition(".")
    holder = module.get_submodule(path) if path else module
    return holder._parameters[attr] if attr in holder._parameters else holder._buffers[attr]  # type: ignore[return-value]


def _check_set(owners: list[_Owner]) -> None:
    unset = _unset(owners, fill=False)
    if unset:
        shown = [
            f"'{o.name}' ({type(o.module).__name__}: {names}, by "
            + (f"{type(o.rule.pretrained).__name__}._init_weights)" if o.rule.tuner == "" else f"'{o.rule.tuner}')")
            for o, names in unset
        ]
        raise PipelineConfigError(
            f"Materialising modules built on meta, their library's initialiser left tensors unset: {', '.join(shown)}."
            " Give each such module a `reset_parameters(self)`, or pass PipelineStrategy(init_fn=fn) where"
            " fn(module, name) initialises any module's own tensors, or load them with init_weights."
        )


def check_materialized(module: nn.Module) -> None:
    """A checkpoint of meta tensors would hold no weights: refuse it (on every rank alike) instead."""
    meta = [n for n, t in module.state_dict(keep_vars=True).items() if t.is_meta]
    if meta:
        raise PipelineConfigError(
            f"Cannot save {type(module).__name__}: {len(meta)} of its tensors ({meta[:3]}...) are still on the meta"
            " device, because no batch has run since it was built on meta (a resumed run that was already"
            " complete?). Each rank materialises its stage at the first batch; save after training at least one"
            " batch, or keep the checkpoint you resumed from."
        )


def _named_own(module: nn.Module) -> Iterator[tuple[str, torch.Tensor]]:
    yield from module.named_parameters(recurse=False)
    yield from ((n, b) for n, b in module.named_buffers(recurse=False) if b is not None)


def _check_metrics(module: nn.Module) -> None:
    try:
        from torchmetrics import Metric
    except ImportError:  # pragma: no cover - torchmetrics is a dependency
        return
    for name, m in module.named_modules():
        if isinstance(m, Metric) and any(
            isinstance(v, torch.Tensor) and v.is_meta for v in (getattr(m, s) for s in m._defaults)
        ):
            raise PipelineConfigError(
                f"The torchmetrics object '{name}' ({type(m).__name__}) has its state on the meta device, where it"
                " would compute garbage. Create metrics outside `with torch.device('meta')`: under"
                " trainer.init_module() and configure_model the strategy keeps them real by itself."
            )


def materialize(
    module: nn.Module,
    device: torch.device | str = "cpu",
    seed: int | None = None,
    init_fn: InitFn | None = None,
    prefix: str = "",
    loaded: Collection[str] = frozenset(),
    within: nn.Module | None = None,
) -> nn.Module:
    """Allocate ``module``'s meta tensors on ``device`` and initialise them by the name rule; move the rest.

    Each module owning meta tensors runs its initialiser under ``torch.manual_seed(name_seed(seed, name))``
    with the global RNG left untouched: ``init_fn(module, name)`` if given; else as its library starts it
    eagerly (inside a transformers model: its own ``reset_parameters`` if any, then the model's
    ``_init_weights(module)``; a peft LoRA layer, after its adapters' modules: ``reset_lora_parameters(adapter,
    init_lora_weights)``, so ``lora_B`` starts at zero); else its own ``reset_parameters()`` (or
    ``_reset_parameters()``). A tensor a library's initialiser leaves unset is refused, naming it. ``name`` is
    the module's qualified name in the whole model (``prefix`` is ``module``'s own; ``within``, the module
    ``module`` sits in at ``prefix``, such as a stage view holding an FSDP unit, tells which library's model and
    adapters it is part of), so a pruned pipeline stage gets exactly the tensors the whole model gets on one
    process. Parameter objects keep their identity (ties, optimizers built earlier and hooks stay valid),
    except tensor-parallel DTensors: each is initialised whole, as on one process, and replaced by this rank's
    piece. A module all of whose meta tensors are in ``loaded`` (qualified names a pretrained checkpoint or
    adapter directory sets next) is allocated only.
    """
    device = torch.device(device)
    seed = global_seed() if seed is None else seed
    owners = _owners(module, prefix, loaded, _rules(within) if within is not None else _rules(module, prefix))
    if owners:
        _check_metrics(module)
        if init_fn is None:
            _check_owners(module, owners)
    initializers = [(o.name, _initializer(o, init_fn)) for o in owners]
    checked = _library_set(owners) if init_fn is None else []
    with contextlib.ExitStack() as whole:
        for owner in owners:
            whole.enter_context(whole_parameters(owner.module))
        _allocate(module, device)
        index = (
            device.index if device.index is not None else torch.cuda.current_device() if device.type == "cuda" else 0
        )
        cuda = [index] if device.type == "cuda" else []
        with torch.random.fork_rng(devices=cuda), torch.no_grad():
            _unset(checked, fill=True)
            for name, initialize in initializers:
                torch.manual_seed(name_seed(seed, name))
                initialize()  # type: ignore[operator]
            _check_set(checked)
    return module


def _allocate(module: nn.Module, device: torch.device) -> None:
    """Meta tensors allocated on ``device``, others moved there; each Parameter object keeps its identity (its
    contents are swapped), so ties and optimizers built earlier stay valid. Tensors already on ``device``
    (units FSDP has sharded) are left alone."""
    for m in module.modules():
        for t in list(m._parameters.values()):
            if t is not None and (t.is_meta or t.device != device):
                real = torch.empty_like(t, device=device) if t.is_meta else t.detach().to(device)
                torch.utils.swap_tensors(t, nn.Parameter(real, requires_grad=t.requires_grad))
        for name, b in list(m._buffers.items()):
            if b is not None and (b.is_meta or b.device != device):
                m._buffers[name] = torch.empty_like(b, device=device) if b.is_meta else b.to(device)


@contextlib.contextmanager
def on_meta(module: nn.Module) -> Iterator[Callable[[Any], Any]]:
    """Run code on ``module`` with every tensor on meta: its real parameters and buffers for the duration
    of the block, new tensors by default, and inputs through the returned converter.

    A real tensor must never meet a meta weight: ``F.linear(cpu_x, meta_w)`` returns uninitialised CPU
    memory instead of failing. A forward that needs values (``.item()``, boolean masks,
    data-dependent shapes) fails here with the module and operation named.
    """
    saved: list[tuple[dict[str, Any], str, torch.Tensor]] = []
    stand_ins: dict[int, torch.Tensor] = {}  # one per tensor, so that tied parameters stay tied
    for m in module.modules():
        for slots in (m._parameters, m._buffers):
            for name, t in slots.items():
                if t is not None and not t.is_meta:
                    if id(t) not in stand_ins:
                        meta = t.to("meta")
                        stand_ins[id(t)] = nn.Parameter(meta, t.requires_grad) if isinstance(t, nn.Parameter) else meta
                    saved.append((slots, name, t))
                    slots[name] = stand_ins[id(t)]
    running: list[str] = []  # the modules whose forward has started and not returned, innermost last
    names = {id(m): name for name, m in module.named_modules()}

    def started(m: nn.Module, _: Any) -> None:
        running.append(names.get(id(m), type(m).__name__))

    def returned(*_: Any) -> None:  # a forward hook's return value would replace the output
        running.pop()

    hooks = (
        nn.modules.module.register_module_forward_pre_hook(started),
        nn.modules.module.register_module_forward_hook(returned),
    )
    try:
        with torch.device("meta"):
            yield lambda tree: tree_map_only(torch.Tensor, lambda t: t.to("meta"), tree)
    except PipelineConfigError:
        raise
    except Exception as error:
        where = f"in '{running[-1]}'" if running else f"in {type(module).__name__}.forward itself"
        raise PipelineConfigError(
            f"The forward of {type(module).__name__}, built on the meta device, cannot run without data ({where}:"
            f" {type(error).__name__}: {error}). The strategy learns where each part runs from a forward on"
            " meta tensors. Keep value-dependent code (.item(), bool(tensor), boolean-mask indexing,"
            " nonzero/unique, data-dependent shapes) out of forward, e.g. compute it in the step or the"
            " DataLoader and pass the result in; or build the module eagerly (outside trainer.init_module()"
            " and configure_model)."
        ) from error
    finally:
        for hook in hooks:
            hook.remove()
        for slots, name, t in saved:
            slots[name] = t
