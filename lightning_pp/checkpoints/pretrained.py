"""``init_weights=PATH``: each rank reads only its own tensors of a pretrained checkpoint.

A model too large for one device is built on meta, and a fine-tuning run starts from someone else's
weights: a Hugging Face directory of safetensors shards, a torch state-dict file, a
``torch.distributed.checkpoint`` directory (lightning-pp's ``"sharded"`` checkpoints, torchtitan's seed
checkpoints). Opening one reads names, shapes and dtypes only; the names are matched against the whole
module on every rank alike (so every rank fails alike, before any collective); once a rank's stages
exist, ``torch.distributed.checkpoint`` reads exactly their tensors (the slices a rank holds of a
DTensor), or, for a torch file, the pages of a memory-mapped file that those tensors occupy.

Names: a checkpoint key matches a tensor by name, or after the one prefix that makes most of them match
(an HF model held at ``self.model`` is ``model.`` ahead of the checkpoint's names); ``init_weights_keys``
maps the rest (``name -> key``, or ``None``: left to the module's initialiser). A tied tensor is found
under any of its names (HF leaves ``lm_head.weight`` out when it is the embedding). Under peft (a
``get_peft_model`` held at an attribute, or adapters injected) the base's tensors are matched by the base
model's own names (``...q_proj.base_layer.weight`` as ``...q_proj.weight``, peft's wrapper left off,
``checkpoints.adapters``); the adapters' tensors are left to peft's initialisation or ``init_adapter``.
Opened for a module that holds a ``transformers`` model, the keys are those ``from_pretrained`` would load: renamed,
and per-expert tensors fused, by the model's own conversion list (``checkpoints.hf_conversion``).
"""

from __future__ import annotations

import contextlib
import os
import tempfile
from collections.abc import Iterator, Mapping
from dataclasses import dataclass, field
from pathlib import Path
from typing import Literal

import torch
from lightning.pytorch.utilities.rank_zero import rank_zero_info
from torch import nn

from lightning_pp.checkpoints.adapters import adapter_sites, site_of
from lightning_pp.checkpoints.formats import META_FILE
from lightning_pp.checkpoints.hf_conversion import Conversion, convert_keys, read_converted
from lightning_pp.checkpoints.trust import SafeReader, read_dcp
from lightning_pp.errors import PipelineConfigError
from lightning_pp.layout.dtensors import local_tensor, shard_like
from lightning_pp.layout.options import KeyFn

Format = Literal["hf", "safetensors", "torch", "dcp"]
_TORCH_SUFFIXES = (".pt", ".pth", ".bin", ".ckpt")
_WRAPPERS = ("state_dict", "model")  # Lightning's .ckpt, nanoGPT's ckpt.pt
_OWN_PREFIX = "model."  # the weights of lightning-pp's own sharded checkpoint, beside "optimizers."


@dataclass(frozen=True)
class Pretrained:
    """A checkpoint opened without reading its tensors: each key's shape and dtype."""

    path: Path
    format: Format
    shapes: Mapping[str, tuple[tuple[int, ...], torch.dtype]]
    strip: str = ""  # a prefix every key of the file carries that is not part of the weights' names
    # keys of ``shapes`` that transformers builds at load from other keys of the file (fused experts, renamings)
    converted: Mapping[str, Conversion] = field(default_factory=dict)


@dataclass(frozen=True)
class WeightMap:
    """Which checkpoint key each of the module's tensors comes from, decided on the whole module."""

    keys: Mapping[str, str]  # the module's tensor name -> the checkpoint key
    left: frozenset[str] = field(default_factory=frozenset)  # parameters left to their initialiser
    prefix: str = ""  # how names were matched: "" exact, "-p" p stripped from names, "+p" p added
    adapters: frozenset[str] = field(default_factory=frozenset)  # peft adapters' parameters: not in the checkpoint


def open_pretrained(path: str | os.PathLike, module: nn.Module | None = None) -> Pretrained:
    """The checkpoint at ``path``, its format recognised from what is there; no tensor is read. With ``module``
    (the whole module, meta or real), its keys as transformers converts them for the model ``module`` holds."""
    pretrained = _open(Path(path).expanduser())
    return pretrained if module is None else convert_keys(pretrained, module)


def _open(path: Path) -> Pretrained:
    if path.is_dir() and any(path.glob("*.safetensors")):
        return Pretrained(path, "hf", _safetensors_shapes(sorted(path.glob("*.safetensors"))))
    if path.is_file() and path.suffix == ".safetensors":
        return Pretrained(path, "safetensors", _safetensors_shapes([path]))
    if path.is_dir() and (path / ".metadata").is_file():
        return _open_dcp(path)
    if path.is_file() and path.suffix in _TORCH_SUFFIXES:
        state = _torch_state(path)
        return Pretrained(path, "torch", {k: (tuple(v.shape), v.dtype) for k, v in state.items()})
    raise PipelineConfigError(
        f"init_weights={str(path)!r} is not a checkpoint lightning-pp can read: give a Hugging Face model directory"
        " (*.safetensors, with model.safetensors.index.json when sharded), a .safetensors file, a torch state-dict"
        f" file ({', '.join(_TORCH_SUFFIXES)}), or a torch.distributed.checkpoint directory (with .metadata)."
        + ("" if path.exists() else " Nothing exists at that path.")
    )


def match_weights(
    pretrained: Pretrained, module: nn.Module, keys: KeyFn | None = None, adapters_from: str = "peft's initialisation"
) -> WeightMap:
    """The key of each of ``module``'s tensors (the whole module, meta or real, the same on every rank).

    Refuses, naming them, parameters that neither the checkpoint nor ``keys`` provide, checkpoint keys that
    no tensor takes, and shapes that differ; says once where a dtype is cast, and how many peft adapter tensors
    start from ``adapters_from`` instead (``keys`` may still map them).
    """
    state = module.state_dict(keep_vars=True)
    aliases = _aliases(state)  # one entry per tensor: all its names
    base = _base_names(module, [n for group in aliases for n in group])
    prefix, by_prefix = _best_prefix([b for b in base.values() if b is not None], set(pretrained.shapes))
    peft = any(b is not None and b != n for n, b in base.items())
    found: dict[str, str] = {}
    left: set[str] = set()
    adapters: set[str] = set()
    unknown: dict[str, str] = {}
    params = {n for n, _ in module.named_parameters(remove_duplicate=False)}
    used: set[str] = set()
    for group in aliases:
        under = [by_prefix[b] for b in (base[n] for n in group) if b in by_prefix]  # a tied tensor: under each name
        used.update(under)
        key = under[0] if under else None
        adapter = all(base[n] is None for n in group)
        if key is None and keys is not None:
            mapped = [(n, keys(n)) for n in group]
            if all(k is None for _, k in mapped):
                (adapters if adapter else left).update(n for n in group if n in params)
                continue
            name, key = next((n, k) for n, k in mapped if k is not None)
            if key not in pretrained.shapes:
                unknown[name] = key
                continue
        if key is None and adapter:
            adapters.update(n for n in group if n in params)
        elif key is not None:
            found.update(dict.fromkeys(group, key))
    missing = [g[0] for g in aliases if any(n in params for n in g) and g[0] not in found.keys() | left | adapters]
    if unknown or missing:
        lacks = [f"the keys init_weights_keys gave: {_few(unknown)}"] if unknown else []
        lacks += [f"{len(missing)} of {type(module).__name__}'s parameters: {_few(missing)}"] if missing else []
        raise PipelineConfigError(
            f"init_weights={str(pretrained.path)!r} does not hold {'; nor '.join(lacks)}"
            f" ({_how_names_matched(prefix, peft)})."
            " Give PipelineStrategy(init_weights_keys=fn) with fn(name) -> the checkpoint's key, or None for a"
            " tensor its module's initialiser should set."
        )
    used.update(found.values())
    unused = sorted(k for k in pretrained.shapes if k not in used)
    if unused:
        converted = sum(k in pretrained.converted for k in unused)
        named = f"; {converted} of them named as transformers converts them at load" if converted else ""
        raise PipelineConfigError(
            f"init_weights={str(pretrained.path)!r} holds {len(unused)} tensors that no tensor of"
            f" {type(module).__name__} takes ({_how_names_matched(prefix, peft)}): {_few(unused)}{named}. Is it the"
            " checkpoint of this model and configuration? Map its names with PipelineStrategy(init_weights_keys=fn)."
        )
    wrong = {n: (pretrained.shapes[k][0], tuple(state[n].shape)) for n, k in found.items() if n in state}
    wrong = {n: s for n, s in wrong.items() if s[0] != s[1]}
    if wrong:
        shown = [
            f"{n} {list(a)} in the checkpoint"
            + (f" ({_converted(pretrained.converted[found[n]])})" if found[n] in pretrained.converted else "")
            + f", {list(b)} in the module"
            for n, (a, b) in list(wrong.items())[:5]
        ]
        raise PipelineConfigError(
            f"init_weights={str(pretrained.path)!r}: shapes differ for {len(wrong)} tensors: {'; '.join(shown)}."
            " Build the module with the checkpoint's configuration."
        )
    casts = {(pretrained.shapes[k][1], state[n].dtype) for n, k in found.items() if n in state}
    message = f"init_weights: {len(used)} tensors from {pretrained.path} ({_how_names_matched(prefix, peft)})"
    built = {id(c): c for k, c in pretrained.converted.items() if k in used}.values()
    if built:
        sources = sum(len(c.keys) for c in built)
        message += f"; {len(built)} built or renamed from {sources} checkpoint tensors as transformers loads them"
    if left:
        message += f"; {len(left)} parameters left to their initialiser"
    if adapters:
        kinds = sorted({p for n in adapters for p in n.split(".") if p.startswith("lora_")})
        message += f"; {len(adapters)} adapter tensors ({', '.join(kinds)}) start from {adapters_from}"
    if any(a != b for a, b in casts):
        message += "; cast " + ", ".join(sorted(f"{a} -> {b}" for a, b in casts if a != b))
    rank_zero_info(message)
    return WeightMap(found, frozenset(left), prefix, frozenset(adapters))


def load_weights(pretrained: Pretrained, weights: WeightMap, module: nn.Module) -> int:
    """Copy this rank's tensors (its stages of the module, materialised) out of the checkpoint.

    Returns the bytes of the checkpoint's tensors asked for (a DTensor's piece, not the whole tensor).
    """
    wanted: dict[str, torch.Tensor] = {}
    copies: list[tuple[str, torch.Tensor]] = []  # a second tensor of one key: a peft modules_to_save copy
    for name, tensor in module.state_dict(keep_vars=True).items():
        if name in weights.keys and tensor is not None:
            key = weights.keys[name]
            if key in wanted and wanted[key] is not tensor:  # a tied tensor is one object under several names
                copies.append((key, tensor.detach()))
            wanted.setdefault(key, tensor)
    if not wanted:
        return 0
    wanted = {k: t.detach() for k, t in wanted.items()}
    read_keys(pretrained, wanted)
    with torch.no_grad():
        for key, tensor in copies:
            tensor.copy_(wanted[key])
    return sum(local_tensor(t).numel() * pretrained.shapes[k][1].itemsize for k, t in wanted.items())


def read_keys(pretrained: Pretrained, wanted: Mapping[str, torch.Tensor]) -> None:
    """Copy these checkpoint keys into their tensors (a DTensor's piece of each), reading nothing else; a converted
    key is built from the file's tensors it comes from."""
    plain = {k: t for k, t in wanted.items() if k not in pretrained.converted}
    if plain:
        _read_plain(pretrained, plain)
    if len(plain) < len(wanted):
        converted = {k: t for k, t in wanted.items() if k in pretrained.converted}
        with torch.no_grad():
            read_converted(converted, pretrained.converted, lambda sources: _read_plain(pretrained, sources))


def _read_plain(pretrained: Pretrained, wanted: Mapping[str, torch.Tensor]) -> None:
    with torch.no_grad():
        if pretrained.format == "torch":
            state = _torch_state(pretrained.path)
            for key, tensor in wanted.items():
                local_tensor(tensor).copy_(local_tensor(shard_like(state[key], tensor)))
        else:
            _dcp_load(pretrained, dict(wanted))


def _dcp_load(pretrained: Pretrained, wanted: dict[str, torch.Tensor]) -> None:
    """``torch.distributed.checkpoint`` reads the requested keys only (slices of them for DTensors), casting on copy."""
    from torch.distributed.checkpoint import HuggingFaceStorageReader

    with _reader_path(pretrained) as where:
        reader = SafeReader(where) if pretrained.format == "dcp" else HuggingFaceStorageReader(str(where))
        read_dcp({pretrained.strip + k: t for k, t in wanted.items()}, pretrained.path, None, reader=reader)


@contextlib.contextmanager
def _reader_path(pretrained: Pretrained) -> Iterator[Path]:
    """The directory DCP's reader opens: a single ``.safetensors`` file alone in one (its siblings stay unread)."""
    if pretrained.format != "safetensors":
        yield pretrained.path
        return
    with tempfile.TemporaryDirectory() as alone:
        link = Path(alone) / pretrained.path.name
        link.symlink_to(pretrained.path.resolve())
        yield Path(alone)


def _safetensors_shapes(files: list[Path]) -> dict[str, tuple[tuple[int, ...], torch.dtype]]:
    from safetensors import safe_open
    from safetensors.torch import _getdtype

    shapes: dict[str, tuple[tuple[int, ...], torch.dtype]] = {}
    for file in files:
        with safe_open(str(file), framework="pt") as f:
            for key in f.keys():
                piece = f.get_slice(key)
                shapes[key] = (tuple(piece.get_shape()), _getdtype(piece.get_dtype()))
    return shapes


def _open_dcp(path: Path) -> Pretrained:
    from torch.distributed.checkpoint.metadata import TensorStorageMetadata

    metadata = SafeReader(path).read_metadata().state_dict_metadata
    tensors = {
        k: (tuple(m.size), m.properties.dtype) for k, m in metadata.items() if isinstance(m, TensorStorageMetadata)
    }
    if (path / META_FILE).is_file():  # lightning-pp's own: the weights under "model.", beside optimizer state
        own = {k[len(_OWN_PREFIX) :]: v for k, v in tensors.items() if k.startswith(_OWN_PREFIX)}
        return Pretrained(path, "dcp", own, strip=_OWN_PREFIX)
    return Pretrained(path, "dcp", tensors)


def _torch_state(path: Path) -> dict[str, torch.Tensor]:
    """A torch file's state dict, memory-mapped: a tensor's pages are read when it is copied out."""
    try:
        state = torch.load(path, mmap=True, map_location="cpu", weights_only=True)
    except RuntimeError:  # a file torch.save wrote without the zip format cannot be mapped
        state = torch.load(path, map_location="cpu", weights_only=True)
    for wrapper in _WRAPPERS:
        if isinstance(state, Mapping) and isinstance(state.get(wrapper), Mapping):
            state = state[wrapper]
    if not isinstance(state, Mapping):
        raise PipelineConfigError(f"init_weights={str(path)!r} holds a {type(state).__name__}, not a state dict.")
    return {k: v for k, v in state.items() if isinstance(v, torch.Tensor)}


def _base_names(module: nn.Module, names: list[str]) -> dict[str, str | None]:
    """Each name as the base model names the tensor (inside a peft wrapper: ``...q_proj.weight``), None for a peft
    adapter's tensors; names outside any peft model unchanged."""
    sites = adapter_sites(module)
    if not sites:
        return {n: n for n in names}
    base: dict[str, str | None] = {}
    for n in names:
        site = site_of(sites, n)
        base[n] = n if site is None else site.base_key(n)
    return base


def _aliases(state: Mapping[str, torch.Tensor]) -> list[list[str]]:
    """Every tensor of a module's state dict once, with all the names it goes by (tied ones have several)."""
    groups: dict[int, list[str]] = {}
    for name, tensor in state.items():
        if tensor is not None:
            groups.setdefault(id(tensor), []).append(name)
    return list(groups.values())


def _best_prefix(names: list[str], keys: set[str]) -> tuple[str, dict[str, str]]:
    """The one prefix of any depth (stripped from names, or added to them) under which the most names are keys."""
    candidates = {""}
    for n in names:
        parts = n.split(".")
        candidates.update(f"-{'.'.join(parts[:i])}." for i in range(1, len(parts)))
    for k in keys:
        parts = k.split(".")
        candidates.update(f"+{'.'.join(parts[:i])}." for i in range(1, len(parts)))

    def under(prefix: str) -> dict[str, str]:
        if not prefix:
            return {n: n for n in names if n in keys}
        p = prefix[1:]
        if prefix[0] == "-":
            return {n: n[len(p) :] for n in names if n.startswith(p) and n[len(p) :] in keys}
        return {n: p + n for n in names if p + n in keys}

    best = max(sorted(candidates, key=len), key=lambda p: len(under(p)))  # ties: the shortest (none) first
    return best, under(best)


def _how_names_matched(prefix: str, peft: bool = False) -> str:
    steps = ", peft's wrapper and .base_layer steps left off" if peft else ""
    if not prefix:
        return f"names matched as they are{steps}"
    p = prefix[1:]
    return f"names matched with {p!r} {'left off' if prefix[0] == '-' else 'put in front'}{steps}"


def _converted(conversion: Conversion) -> str:
    keys = conversion.keys
    if conversion.transform is None:
        return f"renamed by transformers from {keys[0]}"
    return f"built by transformers' conversion from {keys[0]} and {len(keys) - 1} more"


def _few(items: Mapping[str, str] | list[str]) -> str:
    shown = [f"{k} -> {v!r}" for k, v in items.items()] if isinstance(items, Mapping) else list(items)
    return ", ".join(shown[:5]) + (f" and {len(shown) - 5} more" if len(shown) > 5 else "")
