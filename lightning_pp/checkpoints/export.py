"""Trained weights out: in Hugging Face's format (safetensors shards, their index, the model's config), or a peft
adapter directory.

A checkpoint written under the pipeline records (``export_names``) the names its weights came in with
(``init_weights``' keys, and where from), the tensors the run trained, the peft adapters it holds and, where the
LightningModule holds a ``transformers`` model, that model's config and where it sits. ``export_hf`` then writes
one shard at a time, reading only that shard's tensors (from a sharded directory through
``torch.distributed.checkpoint``, from a full ``.ckpt`` through a memory map), so the whole model is never in
memory; ``from_pretrained(DST)`` returns it, LoRA adapters merged into their base weights. ``export_peft`` writes
an adapter's own tensors under peft's names. An export that would leave out trained tensors is refused.
"""

from __future__ import annotations

import json
import sys
from collections.abc import Callable, Mapping
from pathlib import Path
from typing import Any

import torch
from torch import nn

from lightning_pp.checkpoints.adapters import (
    ADAPTER_CONFIG,
    ADAPTER_WEIGHTS,
    AdapterSite,
    parameter_wrappers,
    site_of,
)
from lightning_pp.checkpoints.export_peft import (
    LoraMerge,
    adapter_config,
    check_kept,
    lora_merges,
    peft_tensors,
    record_adapters,
    recorded_sites,
)
from lightning_pp.checkpoints.formats import META_FILE, is_sharded
from lightning_pp.checkpoints.frozen import FROZEN_KEY, check_base
from lightning_pp.checkpoints.hf_conversion import model_of_directory
from lightning_pp.checkpoints.integrity import check_checkpoint
from lightning_pp.checkpoints.pretrained import Pretrained, WeightMap, open_pretrained, read_keys
from lightning_pp.checkpoints.restore import placeholders
from lightning_pp.checkpoints.trust import load_file, read_dcp
from lightning_pp.errors import PipelineConfigError

EXPORT_KEY = "lightning_pp_export"  # the checkpoint entry the exports read
INDEX_FILE = "model.safetensors.index.json"
Reader = Callable[[list[str]], dict[str, torch.Tensor]]  # names -> those tensors, whole, on the CPU


def export_names(
    module: nn.Module,
    weights: WeightMap | None,
    trainable: set[str] | frozenset[str] | None = None,
    wrapped: Mapping[str, Any] | None = None,
) -> dict[str, Any]:
    """What a checkpoint keeps for the exports: the names weights came in with, the names of the tensors the run
    trains (``trainable``, else the module's own that require grad), its peft adapters and what peft's parameter
    wrappers adapt (``wrapped``, else the module's own), the HF model's config."""
    if trainable is None:
        trainable = {n for n, p in module.named_parameters() if p.requires_grad}
    found: dict[str, Any] = {
        "keys": dict(weights.keys) if weights is not None else {},
        "trainable": sorted(trainable),
        "adapters": record_adapters(module),
        "wrapped": dict(wrapped) if wrapped is not None else parameter_wrappers(module),
    }
    modeling = sys.modules.get("transformers.modeling_utils")  # imported where a module holds an HF model
    if modeling is not None:
        for name, m in module.named_modules():
            if isinstance(m, modeling.PreTrainedModel):
                generation = getattr(m, "generation_config", None)
                found["hf"] = {
                    "prefix": f"{name}." if name else "",
                    "config": m.config.to_dict(),
                    "generation_config": generation.to_dict() if generation is not None else None,
                }
                break
    return found


def export_hf(
    src: Path, dst: Path, max_shard_bytes: int = 5 * 2**30, adapter: str = "default", weights_only: bool | None = None
) -> list[str]:
    """``src`` (a sharded directory or a full ``.ckpt``) as a Hugging Face model directory ``dst``, ``adapter``'s
    LoRA merged into the base weights. ``weights_only=False`` trusts objects the checkpoint carries.

    Returns the names left out: untrained tensors outside the ``transformers`` model a LightningModule holds.
    """
    export, state, read = _open(src, weights_only)
    sites = recorded_sites(export)
    merges = _merges(state, sites, adapter, export.get("wrapped", {}))
    names, left_out = _hf_names(list(state), export, sites, adapter)
    merged = {n for m in merges.values() for n in (m.a, m.b)}
    left_out = [n for n in left_out if n not in merged]
    check_kept(export.get("trainable", ()), left_out, "export the adapter with --format peft, or map these names")
    files = _files(names, state, max_shard_bytes)
    dst.mkdir(parents=True, exist_ok=True)
    for group in files.values():
        tensors = _merged(group, merges, read)
        _write(dst, {names[n]: t for n, t in tensors.items()}, {names[n]: i for i, g in files.items() for n in g})
        del tensors
    _write_index(dst, names, files, state)
    hf = export.get("hf")
    if hf is not None:
        (dst / "config.json").write_text(json.dumps(hf["config"], indent=2))
        if hf.get("generation_config"):
            (dst / "generation_config.json").write_text(json.dumps(hf["generation_config"], indent=2))
    return left_out


def export_peft(src: Path, dst: Path, adapter: str = "default", weights_only: bool | None = None) -> list[str]:
    """``adapter`` of ``src`` as a peft adapter directory (``adapter_config.json``, ``adapter_model.safetensors``)
    that ``PeftModel.from_pretrained(base, dst)`` loads. Returns the keys written."""
    from safetensors.torch import save_file

    export, state, read = _open(src, weights_only)
    site = _one_site(recorded_sites(export), adapter, src)
    keys = peft_tensors(state, site, adapter)
    if not keys:
        raise PipelineConfigError(f"{src} holds no tensors of adapter {adapter!r}.")
    check_kept(export.get("trainable", ()), set(state) - set(keys), "export the merged model with --format hf")
    dst.mkdir(parents=True, exist_ok=True)
    tensors = read(list(keys))
    save_file({keys[n]: t.contiguous() for n, t in tensors.items()}, dst / ADAPTER_WEIGHTS, metadata={"format": "pt"})
    (dst / ADAPTER_CONFIG).write_text(json.dumps(adapter_config(site, adapter), indent=2, sort_keys=True))
    return sorted(keys.values())


def _open(src: Path, weights_only: bool | None) -> tuple[Mapping[str, Any], dict[str, torch.Tensor], Reader]:
    """A checkpoint's export record, its weights (placeholders for a sharded one) and how to read them, checked
    first and read without running code it carries; tensors the checkpoint left out that came from
    ``init_weights`` (a frozen base) are read from there."""
    check_checkpoint(src)
    sharded = is_sharded(src)
    meta = load_file(src / META_FILE if sharded else src, weights_only, mmap=not sharded)
    state = dict(placeholders(src, trust=weights_only is False)[0] if sharded else meta["state_dict"])
    export = meta.get(EXPORT_KEY, {"keys": {}})
    own = set(state)
    base, pretrained = _frozen_base(export, meta.get(FROZEN_KEY), src)
    for name, key in base.items():
        shape, dtype = pretrained.shapes[key]
        state[name] = torch.empty(shape, dtype=dtype, device="meta")

    def read(names: list[str]) -> dict[str, torch.Tensor]:
        mine = [n for n in names if n in own]
        tensors = _read(src, {n: state[n] for n in mine}, weights_only) if sharded else {n: state[n] for n in mine}
        wanted = {base[n]: torch.empty_like(state[n], device="cpu") for n in names if n not in own}
        if wanted:
            read_keys(pretrained, wanted)
        return {**tensors, **{n: wanted[base[n]] for n in names if n not in own}}

    return export, state, read


def _frozen_base(
    export: Mapping[str, Any], record: Mapping[str, Any] | None, src: Path
) -> tuple[dict[str, str], Pretrained | None]:
    """The tensors (name -> ``init_weights`` key) a checkpoint without its frozen base left out, and that base,
    checked as a resume checks it (the same files as when the run read them): the export reads them from there."""
    if not record:
        return {}, None
    left_out = check_base(record, record["init_weights"], src)
    path = record["init_weights"]
    return {n: export["keys"][n] for n in left_out}, open_pretrained(path, model_of_directory(path))


def _merges(
    state: Mapping[str, torch.Tensor], sites: list[AdapterSite], adapter: str, wrapped: Mapping[str, Any]
) -> dict[str, LoraMerge]:
    """``adapter``'s LoRA merges over every site that has it (none for a run without adapters)."""
    having = _having(sites, adapter) if sites else []
    return {w: m for s in having for w, m in lora_merges(state, s, adapter, wrapped).items()}


def _having(sites: list[AdapterSite], adapter: str) -> list[AdapterSite]:
    """The sites that hold ``adapter``; none is refused, naming the adapters there are."""
    having = [s for s in sites if adapter in s.configs]
    if not having:
        raise PipelineConfigError(
            f"no adapter named {adapter!r}: the checkpoint has {sorted({a for s in sites for a in s.configs})};"
            " choose one with --adapter NAME."
        )
    return having


def _merged(group: list[str], merges: Mapping[str, LoraMerge], read: Reader) -> dict[str, torch.Tensor]:
    """The tensors of one file, each adapted weight with its adapter folded in."""
    extra = [n for w in group if w in merges for n in (merges[w].a, merges[w].b)]
    tensors = read(group + extra)
    return {n: merges[n].apply(tensors) if n in merges else tensors[n] for n in group}


def _one_site(sites: list[AdapterSite], adapter: str, src: Path) -> AdapterSite:
    """The one peft model holding ``adapter`` (a peft adapter directory describes one)."""
    if not sites:
        raise PipelineConfigError(
            f"{src} records no peft adapters (a run without adapters, or a checkpoint from before lightning-pp"
            " recorded them): there is no adapter to write; use --format hf."
        )
    having = _having(sites, adapter)
    if len(having) > 1:
        raise PipelineConfigError(
            f"adapter {adapter!r} sits in {len(having)} peft models ({', '.join(s.prefix for s in having)}): a peft"
            " adapter directory holds one; use --format hf (merged)."
        )
    return having[0]


def _hf_names(
    names: list[str], export: Mapping[str, Any], sites: list[AdapterSite], adapter: str
) -> tuple[dict[str, str], list[str]]:
    """Each tensor's name in the export (the key it came in under, else its name inside the HF model, peft's
    ``.base_layer`` out), each written once (a tied tensor's second name is left to the model's config, as
    ``save_pretrained`` does). ``adapter``'s ``modules_to_save`` copies take the place of the modules they copy;
    other adapter tensors are left out (merged, or refused when trained)."""
    keys, hf = export.get("keys", {}), export.get("hf")
    prefix = hf["prefix"] if hf is not None else ""
    out: dict[str, str] = {}  # key -> the first name written under it
    copies: dict[str, str] = {}  # key -> the adapter's copy written under it instead
    left_out: list[str] = []
    for name in names:
        site = site_of(sites, name)
        owner = site.adapter_of(name) if site is not None else None
        if site is not None and owner is not None and not (owner == adapter and site.is_copy(name)):
            left_out.append(name)
            continue
        plain = site.prefix + (site.base_key(name) or "") if site is not None else name
        key = keys.get(name) or (plain[len(prefix) :] if plain.startswith(prefix) else None)
        if key is None:
            left_out.append(name)
        elif owner is not None:
            copies[key] = name
        else:
            out.setdefault(key, name)
    return {name: key for key, name in {**out, **copies}.items()}, left_out


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


def _read(src: Path, wanted: Mapping[str, torch.Tensor], weights_only: bool | None) -> dict[str, torch.Tensor]:
    """These tensors of a sharded checkpoint, whole (DCP joins the pieces every rank wrote)."""
    request = {"model": {n: torch.empty_like(t, device="cpu") for n, t in wanted.items()}}
    read_dcp(request, src, weights_only)
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
