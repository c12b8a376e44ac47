"""Split a batch (any pytree) into equal micro-batches and find what the user's step feeds the model."""

from __future__ import annotations

import contextlib
import dataclasses
from collections.abc import Callable, Iterable, Mapping
from typing import Any, NamedTuple

import torch
from lightning.pytorch.utilities.data import _update_dataloader
from torch import nn
from torch.utils._pytree import (
    SUPPORTED_NODES,
    MappingKey,
    keystr,
    register_dataclass,
    register_pytree_node,
    tree_flatten,
    tree_flatten_with_path,
    tree_unflatten,
)
from torch.utils.data import DataLoader, DistributedSampler, RandomSampler

from lightning_pp.errors import PipelineConfigError
from lightning_pp.layout.schedule import check_batch_size
from lightning_pp.memory.materialize import global_seed
from lightning_pp.split.stage import patched


def known_containers(batch: Any) -> Any:
    """``batch``, with the types of its containers known to torch's pytree, which splits, fingerprints and signs
    every batch: to it a dataclass or a mapping other than a dict (Hugging Face's ``BatchEncoding``, what its data
    collators return) is one leaf, and the batch "holds no tensor". A dataclass is registered by its fields; a
    mapping as its items, rebuilt as ``type(batch)(dict)`` (a type that cannot be stays one leaf). Once per type."""
    if isinstance(batch, torch.Tensor):
        return batch
    kind = type(batch)
    if dataclasses.is_dataclass(batch):
        if kind not in SUPPORTED_NODES:
            register_dataclass(kind)
        children: Iterable[Any] = (getattr(batch, f.name) for f in dataclasses.fields(batch))
    elif isinstance(batch, Mapping):
        if kind not in SUPPORTED_NODES and _rebuilds(batch):
            register_pytree_node(
                kind,
                lambda m: (list(m.values()), list(m.keys())),
                lambda values, keys, kind=kind: kind(dict(zip(keys, values))),
                flatten_with_keys_fn=lambda m: ([(MappingKey(k), v) for k, v in m.items()], list(m.keys())),
            )
        children = batch.values()
    elif isinstance(batch, (list, tuple)):
        children = batch
    else:
        return batch
    for child in children:
        known_containers(child)
    return batch


def _rebuilds(mapping: Mapping) -> bool:
    try:
        return type(mapping)(dict(mapping)).keys() == mapping.keys()
    except Exception:  # noqa: BLE001 (a type built otherwise stays a leaf, and the batch is refused by name)
        return False


def batch_size_of(batch: Any) -> int:
    """Dim 0 of the first tensor with at least one dimension: what the pipeline splits."""
    for leaf in tree_flatten(batch)[0]:
        if isinstance(leaf, torch.Tensor) and leaf.dim() > 0:
            return int(leaf.shape[0])
    raise PipelineConfigError(
        f"The batch ({type(batch).__name__}) holds no tensor with a batch dimension, so it cannot be split"
        " into micro-batches; return tensors from the DataLoader."
    )


def tokens_in(batch: Any) -> int | None:
    """Tokens in a batch whose first leaf is a (batch, sequence) tensor of token ids; else None."""
    first = tree_flatten(batch)[0][0]
    if isinstance(first, torch.Tensor) and first.dim() == 2 and not first.is_floating_point():
        return first.numel()
    return None


def split_batch(batch: Any, n_microbatches: int) -> list[Any]:
    """Split every tensor leaf on dim 0, and every list of as many non-tensor items as samples (the strings or ids
    ``default_collate`` lists per sample: kept whole, each micro-batch would pair the batch's first ones with its
    own rows); scalars and other leaves go to every micro-batch."""
    size = batch_size_of(batch)
    check_batch_size(size, n_microbatches)
    leaves, spec = tree_flatten_with_path(batch, is_leaf=lambda x: _per_sample_list(x, size))
    columns: list[list[Any]] = []
    for path, leaf in leaves:
        if isinstance(leaf, torch.Tensor) and leaf.dim() > 0:
            if leaf.shape[0] != size:
                raise PipelineConfigError(
                    f"The batch leaf {keystr(path) or 'batch'} has {leaf.shape[0]} rows but the batch has {size}"
                    " samples; every tensor in a batch must share dim 0 so that it can be split into"
                    " micro-batches (keep per-dataset constants in the module, not in the batch)."
                )
            columns.append(list(leaf.chunk(n_microbatches)))
        elif _per_sample_list(leaf, size):
            step = size // n_microbatches
            columns.append([leaf[i : i + step] for i in range(0, size, step)])
        else:
            columns.append([leaf] * n_microbatches)
    return [tree_unflatten([col[i] for col in columns], spec) for i in range(n_microbatches)]


def _per_sample_list(x: Any, size: int) -> bool:
    return type(x) is list and len(x) == size and not any(isinstance(t, torch.Tensor) for t in tree_flatten(x)[0])


def merge_microbatches(outputs: list[Any], rows: int) -> Any:
    """What one call on the whole batch would have returned: tensors joined on dim 0, and lists of one item per
    sample of the micro-batch (``rows`` each: the ids or texts a predict step hands back) joined into one.

    Scalars and other non-tensor leaves that agree across micro-batches are kept once; others become a
    list with one entry per micro-batch.
    """
    flat = [tree_flatten(out, is_leaf=lambda x: _per_sample_list(x, rows)) for out in outputs]
    spec = flat[0][1]
    if any(s != spec for _, s in flat):
        return outputs
    merged = []
    for leaves in zip(*(leaves for leaves, _ in flat)):
        first = leaves[0]
        if isinstance(first, torch.Tensor) and first.dim() > 0:
            merged.append(torch.cat(leaves))
        elif _per_sample_list(first, rows):
            merged.append([item for leaf in leaves for item in leaf])
        elif all(_same(first, other) for other in leaves[1:]):
            merged.append(first)
        else:
            merged.append(list(leaves))
    return tree_unflatten(merged, spec)


def _same(a: Any, b: Any) -> bool:
    if isinstance(a, torch.Tensor) and isinstance(b, torch.Tensor):
        return a.shape == b.shape and bool(torch.equal(a, b))
    return a is b or a == b


def signature(batch: Any) -> tuple:
    """Shapes and dtypes of the tensor leaves: the pipeline's buffers are valid for one signature only."""
    return tuple(
        (tuple(x.shape), x.dtype) if isinstance(x, torch.Tensor) else type(x).__name__ for x in tree_flatten(batch)[0]
    )


class ModelCall(NamedTuple):
    """How the user's step called the model: which module (dotted path, "" for the root) and with what."""

    entry: str
    args: tuple
    kwargs: dict


class _Captured(BaseException):
    """Stops the user's step at its model call (BaseException: a broad ``except Exception`` keeps out)."""

    def __init__(self, call: ModelCall) -> None:
        super().__init__()
        self.call = call


def _discard(*_: Any, **__: Any) -> None:
    return None


def capture_model_call(
    module: nn.Module,
    entries: dict[str, nn.Module],
    step: Callable[..., Any],
    step_args: tuple,
    step_kwargs: dict,
    hook_name: str,
) -> ModelCall:
    """Run the user's step up to its model call (``self(...)``, or ``self.model(...)`` for a wrapped
    network) and return that call; nothing after it runs, and logging before it is discarded."""

    def capture(entry: str) -> Callable[..., Any]:
        def forward(*args: Any, **kwargs: Any) -> Any:
            raise _Captured(ModelCall(entry, args, kwargs))

        return forward

    try:
        with contextlib.ExitStack() as stack:
            stack.enter_context(patched(module, log=_discard))
            for name, entry in entries.items():
                stack.enter_context(patched(entry, forward=capture(name)))
            returned = step(*step_args, **step_kwargs)
    except _Captured as found:
        return found.call
    others = f", or one of {sorted(entries)[1:]}" if len(entries) > 1 else ""
    skipped = (
        " It returned None, which skips the batch in plain Lightning; the pipeline's stages run each batch together,"
        " so drop such batches in the DataLoader (its dataset or collate_fn) instead."
        if returned is None
        else ""
    )
    raise PipelineConfigError(
        f"{type(module).__name__}.{hook_name} did not call the model (self(...){others}) for this batch; under the"
        f" pipeline the step must call the model exactly once, with the batch's inputs.{skipped}"
    )


def seeded_shuffle(loader: object) -> object:
    """A loader shuffled by the global RNG (a plain ``RandomSampler``) could draw other batches on each stage of
    one pipeline: the same shuffle from the global seed instead, on every stage."""
    if isinstance(loader, DataLoader) and type(loader.sampler) is RandomSampler and loader.sampler.generator is None:
        sampler = DistributedSampler(loader.dataset, num_replicas=1, rank=0, shuffle=True, seed=global_seed())
        return _update_dataloader(loader, sampler)
    return loader
