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
import hashlib
import os
from collections.abc import Callable, Collection, Iterator
from typing import Any

import torch
from torch import nn
from torch._subclasses.fake_tensor import FakeTensor, FakeTensorMode
from torch.distributed.tensor import DTensor
from torch.utils._pytree import tree_map_only

from lightning_pp.errors import PipelineConfigError
from lightning_pp.layout.dtensors import whole_parameters
from lightning_pp.layout.options import InitFn
from lightning_pp.memory.initializers import (
    check_owners,
    check_set,
    fill_or_find_unset,
    initializer,
    library_rules,
    library_set,
    meta_owners,
)


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


def without_data(t: torch.Tensor) -> bool:
    """A tensor of shapes only: on meta, or fake (a trace's, or ``on_fake``'s)."""
    return t.is_meta or isinstance(t, FakeTensor)


def _own_tensors(module: nn.Module, recurse: bool = False) -> Iterator[torch.Tensor]:
    yield from module.parameters(recurse=recurse)
    yield from (b for b in module.buffers(recurse=recurse) if b is not None)


def check_initializers(
    module: nn.Module, init_fn: InitFn | None = None, loaded: Collection[str] = frozenset(), prefix: str = ""
) -> None:
    """Every module with meta tensors must have an initialiser, unless ``loaded`` (the qualified names a
    pretrained checkpoint sets) holds all of them; checked on the whole module on every rank."""
    _check_metrics(module)
    if init_fn is None:
        check_owners(module, meta_owners(module, prefix, loaded, library_rules(module, prefix)))


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
    owners = meta_owners(
        module, prefix, loaded, library_rules(within) if within is not None else library_rules(module, prefix)
    )
    if owners:
        _check_metrics(module)
        if init_fn is None:
            check_owners(module, owners)
    initializers = [(o.rule.seed_name or o.name, initializer(o, init_fn)) for o in owners]
    checked = library_set(owners) if init_fn is None else []
    with contextlib.ExitStack() as whole:
        for owner in owners:
            whole.enter_context(whole_parameters(owner.module))
        _allocate(module, device)
        index = (
            device.index if device.index is not None else torch.cuda.current_device() if device.type == "cuda" else 0
        )
        cuda = [index] if device.type == "cuda" else []
        with torch.random.fork_rng(devices=cuda), torch.no_grad():
            fill_or_find_unset(checked, fill=True)
            for name, initialize in initializers:
                torch.manual_seed(name_seed(seed, name))
                initialize()  # type: ignore[operator]
            check_set(checked)
    return module


@contextlib.contextmanager
def materialized(module: nn.Module, device: torch.device, init_fn: InitFn | None = None) -> Iterator[None]:
    """``module`` on ``device`` for the block, as ``materialize`` makes it (its meta tensors initialised by the name
    rule or ``init_fn``), then every tensor back where it was, meta ones on meta again, with its attributes: a model
    built on meta that fits on the device can be timed there, as it will train, and still be materialised stage by
    stage."""
    elsewhere = [(p, p.data, dict(p.__dict__)) for p in module.parameters() if p.device != device]
    buffers = [(m._buffers, name, b) for m in module.modules() for name, b in m._buffers.items() if b is not None]
    try:
        materialize(module, device, init_fn=init_fn)
        yield
    finally:
        for p, data, attributes in elsewhere:
            torch.utils.swap_tensors(p, nn.Parameter(data, requires_grad=p.requires_grad))
            p.__dict__.update(attributes)
        for slots, name, b in buffers:
            slots[name] = b


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
        with _stand_ins(module, lambda t: None if t.is_meta else _meta_copy(t)), torch.device("meta"):
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


@contextlib.contextmanager
def on_fake(module: nn.Module, device: torch.device) -> Iterator[Callable[[Any], Any]]:
    """Run code on ``module`` with every tensor a fake one on ``device`` (shapes, no data), inputs through the
    returned converter: ``on_meta`` for code that must be told it is traced. Hugging Face's forward checks values
    (packed sequences' positions, ``.item()``) unless its input is fake, and its MoE experts branch on the device
    (``grouped_mm`` off the CPU, which a meta device takes and cannot run in float32)."""

    def fake(t: torch.Tensor) -> torch.Tensor:
        if isinstance(t, FakeTensor):
            return t
        made = torch.empty_like(t, device=device)
        return nn.Parameter(made, t.requires_grad) if isinstance(t, nn.Parameter) else made

    with FakeTensorMode(allow_non_fake_inputs=True), _stand_ins(module, fake), torch.device(device):
        yield lambda tree: tree_map_only(torch.Tensor, fake, tree)


def _meta_copy(t: torch.Tensor) -> torch.Tensor:
    meta = t.to("meta")
    return nn.Parameter(meta, t.requires_grad) if isinstance(t, nn.Parameter) else meta


@contextlib.contextmanager
def _stand_ins(module: nn.Module, stand_in: Callable[[torch.Tensor], torch.Tensor | None]) -> Iterator[None]:
    """Each parameter and buffer of ``module`` replaced by ``stand_in`` of it (None keeps it) for the block: one per
    tensor, so that tied parameters stay tied."""
    saved: list[tuple[dict[str, Any], str, torch.Tensor]] = []
    made: dict[int, torch.Tensor | None] = {}
    for m in module.modules():
        for slots in (m._parameters, m._buffers):
            for name, t in slots.items():
                if t is not None and id(t) not in made:
                    made[id(t)] = stand_in(t)
                if made.get(id(t)) is not None:
                    saved.append((slots, name, t))
                    slots[name] = made[id(t)]
    try:
        yield
    finally:
        for slots, name, t in saved:
            slots[name] = t
