"""``init_weights`` of a checkpoint whose tensors transformers converts at load (MoE experts, renamed modules).

transformers 5 holds some models' tensors in another layout than their checkpoints: Mixtral, Qwen2/3-MoE,
OLMoE, DeepSeek-V3 and others keep each layer's experts fused (``mlp.experts.gate_up_proj`` [E, 2I, H],
``mlp.experts.down_proj`` [E, H, I]) where ``save_pretrained`` and the Hub store one tensor per expert
(``mlp.experts.0.gate_proj.weight``; Mixtral ``block_sparse_moe.experts.0.w1.weight``). ``from_pretrained``
converts at load, by the model's conversion list (``get_model_conversion_mapping``: ``WeightRenaming``s,
then ``WeightConverter``s whose operations, e.g. ``MergeModulelist(dim=0)`` then ``Concatenate(dim=1)``, build
each target from its sources). This module applies that same list, taken from transformers for the
``PreTrainedModel`` the LightningModule holds (no family named here), so that names and shapes are those
transformers would load, matched before any collective, and each target is built by transformers' own
operations from exactly the checkpoint tensors it needs.

Keys are renamed as transformers renames them (its ``rename_source_key``: every renaming, then at most one
converter), without its ``base_model_prefix`` adjustment: ``pretrained.match_weights`` finds the one prefix
between the checkpoint's names and the module's. A ``torch.distributed.checkpoint`` directory is taken as it
is (lightning-pp's own checkpoints hold the module's names; transformers does not read DCP). A target's shape
and dtype come from running the converter's operations on meta tensors of its sources' shapes, so a source set
they cannot build (experts missing, sizes that differ) is refused at setup, naming the target and its sources.

Reading: a rank builds only the targets its stages hold, reading their sources whole. A DTensor target split only
along the dimension ``MergeModulelist`` stacks the experts on (expert parallelism's ``Shard(0)``, FSDP's dim-0
shard), with nothing but ``Concatenate`` on another dimension after it, is built from the experts of this rank's
slice alone; any other split (tensor parallelism across the fused dimension) is built whole and then cut to the
rank's piece (``shard_like``): correct, at the cost of reading the other ranks' parts of that tensor.
"""

from __future__ import annotations

import copy
import dataclasses
import sys
from collections.abc import Callable, Mapping
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch
from torch import nn

from lightning_pp.errors import PipelineConfigError
from lightning_pp.layout.dtensors import local_tensor, shard_like

Shapes = Mapping[str, tuple[tuple[int, ...], torch.dtype]]
Read = Callable[[dict[str, torch.Tensor]], None]  # copies these checkpoint keys into their tensors
_READ_BYTES = 2**30  # the sources read by one call: fewer calls (each opens the files' headers), bounded memory


@dataclass(frozen=True, eq=False)
class Conversion:
    """Tensors of the model that transformers builds at load from checkpoint tensors under other names."""

    transform: Any  # transformers' WeightConverter (None: a renaming, the one source as it is)
    target: str  # the name transformers gives the first tensor it builds (the converter's ``layer_name``)
    sources: tuple[tuple[str, tuple[str, ...]], ...]  # (source pattern, its checkpoint keys in transformers' order)
    shapes: Shapes  # each source's shape and dtype
    config: Any = None  # the model's config, which some operations read

    @property
    def keys(self) -> list[str]:
        return [k for _, keys in self.sources for k in keys]

    def build(self, tensors: Mapping[str, torch.Tensor]) -> dict[str, torch.Tensor]:
        """The model's tensors (name -> tensor) from these checkpoint tensors, through transformers' own
        operations (a source list left partial by ``tensors`` gives the part they make)."""
        if self.transform is None:
            return {self.target: tensors[self.keys[0]]}
        converter = copy.deepcopy(self.transform)  # as transformers does: one instance per target
        for pattern, keys in self.sources:
            for key in keys:
                if key in tensors:
                    converter.add_tensor(self.target, key, pattern, tensors[key])
        built = converter.convert(self.target, config=self.config)
        return {k: v[0] if isinstance(v, list) else v for k, v in built.items()}

    def local_part(self, like: torch.Tensor) -> dict[str, tuple[tuple[int, ...], torch.dtype]] | None:
        """The sources that build only this rank's piece of ``like`` (a DTensor target), or None where the piece
        is not a run of whole experts stacked by the first operation (the whole target is built then)."""
        from torch.distributed.tensor import DTensor, Shard
        from torch.distributed.tensor._utils import compute_local_shape_and_global_offset
        from transformers.core_model_loading import Concatenate, MergeModulelist

        if not isinstance(like, DTensor) or self.transform is None:
            return None
        first, *rest = self.transform.operations
        if type(first) is not MergeModulelist or any(type(op) is not Concatenate or op.dim == first.dim for op in rest):
            return None
        if not all(p.is_replicate() or type(p) is Shard for p in like.placements):
            return None
        dim = first.dim
        shape, offset = compute_local_shape_and_global_offset(like.shape, like.device_mesh, like.placements)
        if any(a != b for i, (a, b) in enumerate(zip(shape, like.shape)) if i != dim):
            return None
        if shape[dim] == 0 or any(len(keys) != like.shape[dim] for _, keys in self.sources):
            return None
        chosen = slice(offset[dim], offset[dim] + shape[dim])
        return {k: self.shapes[k] for _, keys in self.sources for k in keys[chosen]}


def hf_model(module: nn.Module) -> nn.Module | None:
    """The first ``transformers.PreTrainedModel`` inside ``module`` (itself included); None without one (and
    without importing transformers where the module holds no model of it)."""
    modeling = sys.modules.get("transformers.modeling_utils")
    if modeling is None:
        return None
    return next((m for _, m in module.named_modules() if isinstance(m, modeling.PreTrainedModel)), None)


def model_of_directory(path: Any) -> nn.Module | None:
    """The transformers model an HF directory's ``config.json`` names, on meta: what ``convert_keys`` needs where
    no module is at hand (``consolidate`` of a checkpoint that left its frozen base to ``init_weights``); None for
    other checkpoints."""
    config = Path(path) / "config.json"
    if not config.is_file():
        return None
    import transformers

    hf_config = transformers.AutoConfig.from_pretrained(path)
    architecture = getattr(transformers, (hf_config.architectures or [""])[0], None)
    if architecture is None:
        return None
    with torch.device("meta"):
        return architecture(hf_config)


def convert_keys(pretrained: Any, module: nn.Module) -> Any:
    """``pretrained`` (a ``Pretrained``) as transformers would load it into the model ``module`` holds: its keys
    renamed and the converters' sources replaced by their targets (``shapes``), each target's recipe in
    ``converted``. Unchanged where the module holds no transformers model or its conversion list matches no key
    (gpt-oss and other checkpoints already in the model's layout)."""
    model = hf_model(module)
    if model is None or pretrained.format == "dcp":  # DCP directories hold a module's own names, not the Hub's
        return pretrained
    from transformers.conversion_mapping import get_model_conversion_mapping
    from transformers.core_model_loading import WeightConverter, WeightRenaming, dot_natural_key, rename_source_key

    transforms = get_model_conversion_mapping(model)  # what from_pretrained applies (the legacy renamings too)
    renamings = [t for t in transforms if isinstance(t, WeightRenaming)]
    converters = [t for t in transforms if isinstance(t, WeightConverter)]
    by_pattern = {p: c for c in converters for p in c.source_patterns}
    shapes: dict[str, tuple[tuple[int, ...], torch.dtype]] = {}  # keys as they are
    recipes: dict[str, Conversion] = {}
    built: dict[str, tuple[tuple[int, ...], torch.dtype]] = {}  # the names transformers gives, their shapes
    groups: dict[str, tuple[Any, dict[str, list[str]]]] = {}
    for key in sorted(pretrained.shapes, key=dot_natural_key):  # transformers' order: experts 0, 1, ..., 10
        name, pattern = rename_source_key(key, renamings, converters)
        if pattern is not None:
            groups.setdefault(name, (by_pattern[pattern], {}))[1].setdefault(pattern, []).append(key)
        elif name != key:
            _once(name, recipes, shapes, [key], pretrained.path, model)
            recipes[name] = Conversion(None, name, ((key, (key,)),), {key: pretrained.shapes[key]})
            built[name] = pretrained.shapes[key]
        else:
            shapes[key] = pretrained.shapes[key]
    for target, (converter, sources) in groups.items():
        ordered = tuple((p, tuple(sources[p])) for p in converter.source_patterns if p in sources)
        conversion = Conversion(
            converter, target, ordered, {k: pretrained.shapes[k] for _, ks in ordered for k in ks}, model.config
        )
        for name, shape in _built_on_meta(conversion, pretrained.path, type(model).__name__).items():
            _once(name, recipes, {}, conversion.keys, pretrained.path, model)
            recipes[name], built[name] = conversion, shape
    for name, conversion in recipes.items():
        _once(name, {}, shapes, conversion.keys, pretrained.path, model)
    if not recipes:
        return pretrained
    return dataclasses.replace(pretrained, shapes={**shapes, **built}, converted=recipes)


def read_converted(wanted: Mapping[str, torch.Tensor], converted: Mapping[str, Conversion], read: Read) -> None:
    """Copy these converted targets into their tensors (a DTensor's piece of each): their sources read through
    ``read`` in batches, each target built by transformers' operations, one conversion in memory at a time."""
    jobs: dict[int, tuple[Conversion, dict[str, torch.Tensor]]] = {}
    for name, tensor in wanted.items():
        jobs.setdefault(id(converted[name]), (converted[name], {}))[1][name] = tensor
    batch: list[tuple[Conversion, dict[str, torch.Tensor], Shapes | None]] = []
    size = 0
    for conversion, targets in jobs.values():
        part = conversion.local_part(next(iter(targets.values()))) if len(targets) == 1 else None
        batch.append((conversion, targets, part))
        size += sum(torch.Size(s).numel() * d.itemsize for s, d in (part or conversion.shapes).values())
        if size >= _READ_BYTES:
            _build_batch(batch, read)
            batch, size = [], 0
    if batch:
        _build_batch(batch, read)


def _build_batch(batch: list[tuple[Conversion, dict[str, torch.Tensor], Shapes | None]], read: Read) -> None:
    """Read the sources of these conversions (``part``: only those of this rank's piece) at once, then build and
    copy one conversion at a time."""
    wanted = {k: v for conversion, _, part in batch for k, v in (part or conversion.shapes).items()}
    tensors = {k: torch.empty(s, dtype=d) for k, (s, d) in wanted.items()}
    read(tensors)
    for conversion, targets, part in batch:
        built = conversion.build({k: tensors.pop(k) for k in (part or conversion.shapes)})
        for name, tensor in targets.items():  # from part: this rank's piece itself; else whole, then cut
            value = built[name] if part is not None else local_tensor(shard_like(built[name], tensor))
            local_tensor(tensor).copy_(value)
        del built


def _built_on_meta(conversion: Conversion, path: Any, model: str) -> dict[str, tuple[tuple[int, ...], torch.dtype]]:
    """The names a conversion builds, their shapes and dtypes, found by running it on meta tensors of its sources'
    shapes; a set of sources its operations cannot build is refused, naming them."""
    try:
        built = conversion.build({k: torch.empty(s, dtype=d, device="meta") for k, (s, d) in conversion.shapes.items()})
    except Exception as error:  # transformers' operations raise what torch raises (stack, cat of unlike shapes)
        found = [
            f"{len(k)} under {p!r} ({k[0]} {list(conversion.shapes[k[0]][0])}, ...)" for p, k in conversion.sources
        ]
        raise PipelineConfigError(
            f"init_weights={str(path)!r}: transformers' conversion for {model} cannot build {conversion.target}"
            f" from the checkpoint's tensors: {'; '.join(found)} ({type(error).__name__}: {error}). Is it the"
            " checkpoint of this model, with every expert's tensors?"
        ) from error
    return {k: (tuple(v.shape), v.dtype) for k, v in built.items()}


def _once(name: str, recipes: Mapping[str, Conversion], shapes: Shapes, keys: list[str], path: Any, model: Any) -> None:
    """Refuses a name that two sets of the checkpoint's tensors would both give (transformers would load one)."""
    other = recipes[name].keys if name in recipes else [name] if name in shapes else None
    if other is not None:
        raise PipelineConfigError(
            f"init_weights={str(path)!r} holds {name} twice as transformers converts the names for"
            f" {type(model).__name__}: from {_few(other)} and from {_few(keys)}. Remove one from the checkpoint."
        )


def _few(items: list[str]) -> str:
    return ", ".join(items[:4]) + (f" and {len(items) - 4} more" if len(items) > 4 else "")
