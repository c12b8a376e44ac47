"""Which initialiser a module built on meta runs, as its library would start it eagerly.

``init_fn`` first; a module inside a ``transformers`` model: its own ``reset_parameters`` (if any), then that
model's ``_init_weights(module)`` (what ``from_config`` runs); a peft LoRA layer, after its adapters' modules:
``reset_lora_parameters(adapter, init_lora_weights)`` by its adapter's config (what ``get_peft_model`` runs, so
``lora_B`` starts at zero); any other module: its own ``reset_parameters()``. What a library sets by type is
checked afterwards (a tensor its initialiser does not know would stay uninitialised); DoRA's magnitudes are
computed by peft from the base weights, after ``init_weights`` reads them where it does (``start_from_base``);
what else cannot be drawn without the base weights (PiSSA-like inits, other variants and tuners) is named.
The libraries are looked up only where the user's code imported them.
"""

from __future__ import annotations

import functools
import sys
from collections.abc import Callable, Collection, Iterator
from dataclasses import dataclass, replace
from typing import Any

import torch
from torch import nn

from lightning_pp.errors import PipelineConfigError
from lightning_pp.layout.options import InitFn

INIT_METHODS = ("reset_parameters", "_reset_parameters")
_MAGNITUDE = "lora_magnitude_vector"  # peft's DoRA: a module per adapter, started from the base weights
_BASE = "base_layer"  # the module a peft layer wraps


@dataclass(frozen=True)
class Rule:
    """How the library that built a module initialises it, learned from the modules around it."""

    pretrained: nn.Module | None = None  # the innermost transformers PreTrainedModel holding it: its _init_weights
    lora: tuple[tuple[str, Any], ...] = ()  # a peft LoRA layer: (adapter, init_lora_weights) for each adapter
    dora: tuple[tuple[str, Any], ...] = ()  # of those, (adapter, its config) for each DoRA one: a magnitude
    tuner: str = ""  # inside an adapter of this peft tuner layer (qualified name), which initialises it afterwards
    unknown: str = ""  # why its initialisation cannot be known without the base weights
    seed_name: str = ""  # the name whose seed it draws under, if not its own: a modules_to_save copy's original


_PLAIN = Rule()


@dataclass(frozen=True)
class Owner:
    """A module whose initialiser runs: it owns meta tensors that no checkpoint sets (a LoRA layer: its adapters')."""

    name: str  # qualified, in the whole model
    module: nn.Module
    tensors: tuple[str, ...]  # those tensors, named inside ``module``
    rule: Rule


def check_owners(module: nn.Module, owners: list[Owner]) -> None:
    missing = [(o, why) for o in owners if isinstance(why := initializer(o, None), str)]
    if missing:
        shown = [
            f"'{o.name or '<root>'}' ({type(o.module).__name__}: {sorted(o.tensors)}{'; ' + why if why else ''})"
            for o, why in missing[:3]
        ]
        more = f" and {len(missing) - 3} more" if len(missing) > 3 else ""  # a peft model's every adapted layer
        raise PipelineConfigError(
            f"{type(module).__name__} was built on the meta device, but these modules own meta parameters or"
            f" buffers and have no initialiser: {', '.join(shown)}{more}. Give each a `reset_parameters(self)` that"
            " initialises its own tensors, or pass PipelineStrategy(init_fn=fn) where fn(module, name) initialises"
            " any module's own tensors"
            + (
                ", or start the adapters from PipelineStrategy(init_adapter=DIR), a PEFT adapter directory."
                if any(o.rule.unknown for o, _ in missing)
                else "."
            )
        )


def library_rules(root: nn.Module, prefix: str = "") -> dict[str, Rule]:
    """Each module's rule by qualified name (``prefix`` is ``root``'s), as its library starts it eagerly: a
    module inside a transformers model by that model's ``_init_weights`` (what ``from_config`` runs), a peft
    tuner layer's adapters by the layer's own reset (what ``get_peft_model`` runs), the modules of an adapter
    by torch's rule (peft creates them as plain modules). No library imported: every module is plain."""
    pretrained_type = _imported("transformers.modeling_utils", "PreTrainedModel")
    tuner_type = _imported("peft.tuners.tuners_utils", "BaseTunerLayer")
    rules: dict[str, Rule] = {}
    if pretrained_type is None and tuner_type is None:
        return rules

    def visit(name: str, module: nn.Module, pretrained: nn.Module | None, configs: dict, inside: Rule | None) -> None:
        tuner = inside is None and tuner_type is not None and isinstance(module, tuner_type)
        if inside is not None:
            rule = inside
        elif tuner:
            rule = _tuner_rule(name, module, configs)
        else:
            if pretrained_type is not None and isinstance(module, pretrained_type):
                pretrained = module
            rule = Rule(pretrained=pretrained)
        rules[name] = rule
        own_configs = getattr(module, "peft_config", None)
        configs = own_configs if isinstance(own_configs, dict) and own_configs else configs
        for key, child in module._modules.items():
            if child is not None:
                adapter = tuner and key in getattr(module, "adapter_layer_names", ())
                below = Rule(tuner=name, unknown=rule.unknown) if adapter else inside
                visit(_join(name, key), child, pretrained, configs, below)

    visit(prefix, root, None, {}, None)
    _copies_draw_as_their_originals(root, prefix, rules)
    return rules


def _copies_draw_as_their_originals(root: nn.Module, prefix: str, rules: dict[str, Rule]) -> None:
    """peft starts an adapter's ``modules_to_save`` copy as a deep copy of the module it wraps
    (``original_module``): each module of the copy draws under its original's seed, by the same rule, so both
    start equal as on one process (on its own seed the copy started other than the module it replaces)."""
    wrapper_type = _imported("peft.utils.other", "ModulesToSaveWrapper")
    if wrapper_type is None:
        return
    for name, wrapper in root.named_modules():
        if isinstance(wrapper, wrapper_type):
            for adapter, copy in wrapper.modules_to_save.items():
                for inner, _ in copy.named_modules():
                    qualified = _join(_join(prefix, name), _join(f"modules_to_save.{adapter}", inner))
                    original = _join(_join(prefix, name), _join("original_module", inner))
                    rules[qualified] = replace(rules.get(qualified, _PLAIN), seed_name=original)


def _tuner_rule(name: str, layer: nn.Module, configs: dict[str, Any]) -> Rule:
    """A peft LoRA layer resets each adapter by its config's ``init_lora_weights`` (as ``update_layer`` does), and
    starts DoRA's magnitude from the base; inits drawn from the base weights (PiSSA, OLoRA, LoftQ, ...), other
    variants and other tuners cannot be known on meta."""
    lora_type = _imported("peft.tuners.lora.layer", "LoraLayer")
    if lora_type is None or not isinstance(layer, lora_type):
        return Rule(
            unknown=f"inside peft's {type(layer).__name__} layer '{name}': lightning-pp starts LoRA layers only"
        )
    adapters, dora = [], []
    for adapter in getattr(layer, "r", {}):
        init = getattr(configs.get(adapter), "init_lora_weights", None)
        variant = getattr(layer, "lora_variant", {}).get(adapter)
        where = f"peft's LoRA layer '{name}' (adapter {adapter!r})"
        if adapter in getattr(layer, _MAGNITUDE, {}):
            dora.append((adapter, configs.get(adapter)))
        elif variant is not None:
            return Rule(unknown=f"{where} is a {type(variant).__name__}, which lightning-pp does not start on meta")
        if not (init is True or init is False or (isinstance(init, str) and init.lower() == "gaussian")):
            return Rule(unknown=f"{where} starts with init_lora_weights={init!r}; on meta: True, False or 'gaussian'")
        adapters.append((adapter, init))
    return Rule(lora=tuple(adapters), dora=tuple(dora))


def _imported(module: str, name: str) -> Any:
    """A library's class, if the module defining it is imported already (a model built with it imported it).
    Asked of the defining module, not the package: ``transformers`` resolves its names lazily, and asking it
    would import ``modeling_utils`` (12 MiB of a rank's memory) for models that have nothing of it."""
    return getattr(sys.modules.get(module), name, None)


def _join(prefix: str, name: str) -> str:
    return f"{prefix}.{name}" if prefix and name else name or prefix


def meta_owners(module: nn.Module, prefix: str, loaded: Collection[str], rules: dict[str, Rule]) -> list[Owner]:
    """The modules (qualified names) whose initialiser runs, every module after all of its descendants.

    Children first, as in eager construction: a parent's initialiser may adjust its children's tensors
    (``nn.MultiheadAttention`` zeroes ``out_proj.bias`` after the Linear's own init, a LoRA layer resets its
    adapters' Linears). A module runs it when it owns a meta tensor that no checkpoint sets (``loaded``); a
    LoRA layer, when one of its adapters' tensors is such.
    """
    modules = [(_join(prefix, name), m) for name, m in module.named_modules()]
    loaded = {*loaded, *(t for q, m in modules for t in _started_from_read_base(m, q, rules, loaded))}
    owners = []
    for qualified, m in reversed(modules):
        rule = rules.get(qualified, _PLAIN)
        named = _adapter_tensors(m) if rule.lora else named_own(m)
        tensors = tuple(n for n, t in named if t.is_meta and _join(qualified, n) not in loaded)
        if tensors:
            owners.append(Owner(qualified, m, tensors, rule))
    return owners


def _started_from_read_base(
    layer: nn.Module, qualified: str, rules: dict[str, Rule], loaded: Collection[str]
) -> Iterator[str]:
    """DoRA's magnitudes of a layer whose base a checkpoint sets: started after it is read (``start_from_base``)."""
    rule = rules.get(qualified, _PLAIN)
    if rule.dora and _base_read(layer, qualified, loaded):
        yield from (f"{qualified}.{_MAGNITUDE}.{adapter}.weight" for adapter, _ in rule.dora)


def _base_read(layer: nn.Module, qualified: str, loaded: Collection[str]) -> bool:
    return any(_join(qualified, n) in loaded for n, _ in _named_all(layer) if n.startswith(f"{_BASE}."))


def start_from_base(module: nn.Module, read: Collection[str]) -> None:
    """DoRA's magnitudes of the layers whose base ``init_weights`` has just read (``read``: qualified names), by
    peft's own start: materialising the stage computed none from a base not read yet."""
    for name, rule in library_rules(module).items():
        layer = module.get_submodule(name)
        if rule.dora and _base_read(layer, name, read):
            for adapter, config in rule.dora:
                _start_magnitude(layer, adapter, config)


def _start_magnitude(layer: Any, adapter: str, config: Any) -> None:
    """peft's DoRA start (its variant's ``init``: per output, the norm of the base weight plus the scaled
    ``lora_B @ lora_A``) written into the magnitude the layer holds, whose module and Parameter stay (optimizers,
    a trace's skeleton); the variant builds a new module, which is dropped."""
    held = getattr(layer, _MAGNITUDE)[adapter]
    with torch.no_grad():
        layer.lora_variant[adapter].init(layer, adapter_name=adapter, config=config)
        started = getattr(layer, _MAGNITUDE)[adapter].weight
        getattr(layer, _MAGNITUDE)[adapter] = held
        held.weight.copy_(started)


def _adapter_tensors(layer: nn.Module) -> Iterator[tuple[str, torch.Tensor]]:
    """A peft tuner layer's adapter tensors (``lora_A.default.weight``), not its base layer's."""
    names = getattr(layer, "adapter_layer_names", ())
    yield from ((n, t) for n, t in _named_all(layer) if n.split(".")[0] in names)


def _named_all(module: nn.Module) -> Iterator[tuple[str, torch.Tensor]]:
    yield from module.named_parameters()
    yield from ((n, b) for n, b in module.named_buffers() if b is not None)


def initializer(owner: Owner, init_fn: InitFn | None) -> Callable[[], Any] | str:
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
        dora = [(a, c) for a, c in rule.dora if f"{_MAGNITUDE}.{a}.weight" in owner.tensors]
        return functools.partial(_reset_lora, owner.module, [(a, init) for a, init in rule.lora if a in pending], dora)
    own = next((getattr(owner.module, m) for m in INIT_METHODS if callable(getattr(owner.module, m, None))), None)
    if rule.pretrained is not None:
        return functools.partial(_init_hf, rule.pretrained, owner.module, own)
    if own is not None:
        return own
    if rule.tuner:  # an adapter's tensors outside a Linear (lora_embedding_A): its LoRA layer sets them
        return lambda: None
    return ""


def _reset_lora(layer: Any, adapters: list[tuple[str, Any]], dora: list[tuple[str, Any]]) -> None:
    """As ``update_layer`` starts each adapter: its factors, then (DoRA) its magnitude from them and the base (a
    child, started before its parent)."""
    for adapter, init in adapters:
        layer.reset_lora_parameters(adapter, init)
    for adapter, config in dora:
        _start_magnitude(layer, adapter, config)


def _init_hf(model: Any, module: nn.Module, own: Callable[[], Any] | None) -> None:
    if own is not None:
        own()
    model._init_weights(module)


def library_set(owners: list[Owner]) -> list[Owner]:
    """The owners a library's initialiser sets by type (``_init_weights``, a LoRA layer's reset): checked after."""
    return [o for o in owners if o.rule.pretrained is not None or o.rule.tuner]


def fill_or_find_unset(owners: list[Owner], fill: bool) -> list[tuple[Owner, list[str]]]:
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


def check_set(owners: list[Owner]) -> None:
    unset = fill_or_find_unset(owners, fill=False)
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


def named_own(module: nn.Module) -> Iterator[tuple[str, torch.Tensor]]:
    yield from module.named_parameters(recurse=False)
    yield from ((n, b) for n, b in module.named_buffers(recurse=False) if b is not None)
