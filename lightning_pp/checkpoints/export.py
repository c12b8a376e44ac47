"""Trained weights out in Hugging Face's format: safetensors shards, their index, the model's config.

A checkpoint written under the pipeline records (``export_names``) the names its weights came in with
(``init_weights``' keys) and, where the LightningModule holds a ``transformers`` model, that model's
config and where it sits. ``export_hf`` then writes one shard at a time, reading only that shard's
tensors (from a sharded directory through ``torch.distributed.checkpoint``, from a full ``.ckpt``
through a memory map), so the whole model is never in memory; ``from_pretrained(DST)`` returns it.
"""

from __future__ import annotations

import json
import sys
from collections.abc import Mapping
from pathlib import Path
from typing import Any

import torch
from torch import nn

from lightning_pp.checkpoints.formats import META_FILE, is_sharded
from lightning_pp.checkpoints.pretrained import WeightMap
from lightning_pp.checkpoints.restore import placeholders

EXPORT_KEY = "lightning_pp_export"  # the checkpoint entry export_hf reads
INDEX_FILE = "model.safetensors.index.json"


def export_names(module: nn.Module, weights: WeightMap | None) -> dict[str, Any]:
    """What a checkpoint keeps for the export: the names weights came in with, the HF model's config."""
    found: dict[str, Any] = {"keys": dict(weights.keys) if weights is not None else {}}
    transformers = sys.modules.get("transformers")
    if transformers is not None:
        for name, m in module.named_modules():
            if isinstance(m, transformers.PreTrainedModel):
                generation = getattr(m, "generation_config", None)
                found["hf"] = {
                    "prefix": f"{name}." if name else "",
                    "config": m.config.to_dict(),
                    "generation_config": generation.to_dict() if generation is not None else None,
                }
                break
    return found


def export_hf(src: Path, dst: Path, max_shard_bytes: int = 5 * 2**30) -> list[str]:
    """``src`` (a sharded directory or a full ``.ckpt``) as a Hugging Face model directory ``dst``.

    Returns the names left out: tensors outside the ``transformers`` model a LightningModule holds.
    """
    sharded = is_sharded(src)
    meta = torch.load(src / META_FILE if sharded else src, mmap=not sharded, map_location="cpu", weights_only=False)
    state = placeholders(src)[0] if sharded else meta["state_dict"]
    export = meta.get(EXPORT_KEY, {"keys": {}})
    names, left_out = _hf_names(list(state), export)
    files = _files(names, state, max_shard_bytes)
    dst.mkdir(parents=True, exist_ok=True)
    for group in files.values():
        tensors = _read(src, {n: state[n] for n in group}) if sharded else {n: state[n] for n in group}
        _write(dst, {names[n]: t for n, t in tensors.items()}, {names[n]: i for i, g in files.items() for n in g})
        del tensors
    _write_index(dst, names, files, state)
    hf = export.get("hf")
    if hf is not None:
        (dst / "config.json").write_text(json.dumps(hf["config"], indent=2))
        if hf.get("generation_config"):
            (dst / "generation_config.json").write_text(json.dumps(hf["generation_config"], indent=2))
    return left_out


def _hf_names(names: list[str], export: Mapping[str, Any]) -> tuple[dict[str, str], list[str]]:
    """Each tensor's name in the export (the key it came in under, else its name inside the HF model), each
    written once (a tied tensor's second name is left to the model's config, as ``save_pretrained`` does)."""
    keys, hf = export.get("keys", {}), export.get("hf")
    prefix = hf["prefix"] if hf is not None else ""
    out: dict[str, str] = {}  # key -> the first name written under it
    left_out: list[str] = []
    for name in names:
        key = keys.get(name) or (name[len(prefix) :] if name.startswith(prefix) else None)
        if key is None:
            left_out.append(name)
        else:
            out.setdefault(key, name)
    return {name: key for key, name in out.items()}, left_out


def _files(names: Mapping[str, str], state: Mapping[str, torch.Tensor], limit: int) -> dict[int, list[str]]:
    """Tensors in the order they come, cut into files of at most ``limit`` bytes (a larger tensor alone)."""
    files: dict[int, list[str]] = {}
    size, index = 0, 1
    for name in names:
        nbytes = state[name].numel() * state[name].element_size()
        if files.get(index) and size + nbytes > limit:
            index, size = index + 1, 0
        files.setdefault(index, []).append(name)
        size += nbytes
    return files


def _read(src: Path, wanted: Mapping[str, torch.Tensor]) -> dict[str, torch.Tensor]:
    """These tensors of a sharded checkpoint, whole (DCP joins the pieces every rank wrote)."""
    import torch.distributed.checkpoint as dcp
    from torch.distributed.checkpoint import FileSystemReader

    request = {"model": {n: torch.empty_like(t, device="cpu") for n, t in wanted.items()}}
    dcp.load(request, storage_reader=FileSystemReader(src), no_dist=True)
    return request["model"]


def _write(dst: Path, tensors: dict[str, torch.Tensor], index: dict[str, int]) -> None:
    import torch.distributed.checkpoint as dcp
    from torch.distributed.checkpoint import HuggingFaceStorageWriter

    writer = HuggingFaceStorageWriter(str(dst), fqn_to_index_mapping=index)
    dcp.save({k: t.contiguous() for k, t in tensors.items()}, storage_writer=writer, no_dist=True)


def _write_index(
    dst: Path, names: Mapping[str, str], files: Mapping[int, list[str]], state: Mapping[str, torch.Tensor]
) -> None:
    """The index of every file (DCP's writer indexes the tensors of one ``save`` call: one file here)."""
    from torch.distributed.checkpoint._hf_utils import _gen_file_name

    weight_map = {names[n]: _gen_file_name(i, len(files)) for i, group in files.items() for n in group}
    total = sum(state[n].numel() * state[n].element_size() for n in names)
    (dst / INDEX_FILE).write_text(json.dumps({"metadata": {"total_size": total}, "weight_map": weight_map}, indent=2))
