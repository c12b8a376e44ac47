"""What the two ways out of an adapter run need: the adapters as recorded at save, peft's ``adapter_config.json``,
which tensors go into peft's adapter file, and LoRA folded into the base weights.

A checkpoint records (``record_adapters``) each peft site's prefix and each adapter's config as plain JSON values
(a checkpoint must load with ``weights_only=True``: no peft enums or sets), and the names of the tensors the run
trained. ``consolidate --format peft`` writes the adapter's own tensors under peft's names; ``--format hf`` writes
the merged model: for each LoRA-adapted weight ``W + scaling * (B @ A)`` with peft's own ``scaling``
(``lora_alpha / r``, ``lora_alpha / sqrt(r)`` under ``use_rslora``, ``rank_pattern``/``alpha_pattern`` by peft's
own ``get_pattern_key``), transposed under ``fan_in_fan_out``, and each ``modules_to_save`` copy in place of the
module it copies (as peft's ``merge_and_unload`` does). Any LoRA option that changes that arithmetic (DoRA, LoRA
biases, ...) and any other peft type is refused rather than merged wrong. So is any export that would leave out
tensors the run trained, naming them.
"""

from __future__ import annotations

import enum
import math
from collections.abc import Iterable, Mapping
from dataclasses import dataclass
from typing import Any

import torch
from torch import nn

from lightning_pp.checkpoints.adapters import AdapterSite, adapter_sites
from lightning_pp.errors import PipelineConfigError

# LoRA config fields that do not change the merge (or are peft's truthy defaults); any other one set is refused
_MERGE_NEUTRAL = frozenset(
    {
        "task_type", "peft_type", "auto_mapping", "peft_version", "base_model_name_or_path", "revision",
        "inference_mode", "r", "target_modules", "exclude_modules", "lora_alpha", "lora_dropout", "fan_in_fan_out",
        "bias", "use_rslora", "init_lora_weights", "layers_to_transform", "layers_pattern", "rank_pattern",
        "alpha_pattern", "megatron_core", "loftq_config", "eva_config", "corda_config", "lora_ga_config",
        "qalora_group_size", "ensure_weight_tying", "modules_to_save", "target_parameters",
    }
)  # fmt: skip


def record_adapters(module: nn.Module) -> list[dict[str, Any]]:
    """Each peft site of ``module``: its prefix, holder and each adapter's config, as JSON values."""
    return [
        {"prefix": s.prefix, "holder": s.holder, "configs": {a: _jsonable(c.to_dict()) for a, c in s.configs.items()}}
        for s in adapter_sites(module)
    ]


def recorded_sites(export: Mapping[str, Any]) -> list[AdapterSite]:
    """The sites a checkpoint recorded (their configs as dicts), outermost first."""
    return [AdapterSite(r["prefix"], dict(r["configs"]), r["holder"]) for r in export.get("adapters", [])]


def adapter_config(site: AdapterSite, adapter: str) -> dict[str, Any]:
    """``adapter_config.json`` as peft's ``save_pretrained`` writes it (``inference_mode`` set)."""
    return {**site.configs[adapter], "inference_mode": True}


def peft_tensors(names: Iterable[str], site: AdapterSite, adapter: str) -> dict[str, str]:
    """The adapter's tensors (module name -> key in peft's adapter file)."""
    found = {n: site.peft_key(n) for n in names if site.adapter_of(n) == adapter}
    return {n: k for n, k in found.items() if k is not None}


@dataclass(frozen=True)
class LoraMerge:
    """One LoRA-adapted weight: the module names of ``W``, ``A`` and ``B``, and how peft combines them."""

    weight: str
    a: str
    b: str
    scaling: float
    fan_in_fan_out: bool
    experts: int = 0  # a ParamWrapper's 3-d stack of this many experts' matrices (target_parameters), else 0
    swapped: bool = False  # and stored (experts, out, in)

    def apply(self, tensors: Mapping[str, torch.Tensor]) -> torch.Tensor:
        """``W + scaling * (B @ A)`` (transposed under ``fan_in_fan_out``), in float32, back in ``W``'s dtype; for
        a stack of experts, each expert's ``B_e @ A_e`` from its rank-sized slices, as peft's
        ``ParamWrapper.get_delta_weight`` cuts them (A's rows expert-major, B's columns rank-major)."""
        w, a, b = tensors[self.weight], tensors[self.a].float(), tensors[self.b].float()
        if self.experts:
            a, b = a.reshape(self.experts, -1, a.shape[-1]), b.reshape(b.shape[0], -1, self.experts)
            delta = torch.einsum("ore,eri->eoi" if self.swapped else "ore,eri->eio", b, a)
        else:
            delta = b @ a
        return (w.float() + self.scaling * (delta.T if self.fan_in_fan_out else delta)).to(w.dtype)


def lora_merges(
    state: Mapping[str, torch.Tensor], site: AdapterSite, adapter: str, wrapped: Mapping[str, Any]
) -> dict[str, LoraMerge]:
    """Every weight ``adapter`` adapts in ``site`` (keyed by the base weight's module name; ``wrapped``: what each of
    peft's parameter wrappers adapts, see ``parameter_wrappers``); refuses what peft's plain LoRA merge does not
    cover."""
    config = site.configs[adapter]
    if config.get("peft_type") != "LORA":
        raise PipelineConfigError(
            f"adapter {adapter!r} is peft type {config.get('peft_type')!r}: only LoRA is merged here. Export it with"
            " --format peft, or merge it with peft's merge_and_unload() in one process."
        )
    unusual = sorted(k for k, v in config.items() if k not in _MERGE_NEUTRAL and v)
    if unusual:
        shown = ", ".join(f"{k}={config[k]!r}" for k in unusual)
        raise PipelineConfigError(
            f"adapter {adapter!r} sets {shown}: the merged export covers plain LoRA (W + scaling * B @ A) only."
            " Export it with --format peft, or merge it with peft's merge_and_unload() in one process."
        )
    pairs: dict[str, dict[str, str]] = {}
    for name in state:
        if site.adapter_of(name) == adapter and not site.is_copy(name):  # a modules_to_save copy replaces, whole
            module, _, rest = name.partition(f".{adapter}.")
            module, _, kind = module.rpartition(".")
            if kind not in ("lora_A", "lora_B") or rest != "weight":
                raise PipelineConfigError(
                    f"cannot merge {name}: the merged export covers LoRA's lora_A/lora_B weights of Linear layers."
                    " Export it with --format peft."
                )
            pairs.setdefault(module, {})[kind] = name
    merges = [_merge(state, site, adapter, m, p, wrapped.get(m)) for m, p in pairs.items()]
    return {merge.weight: merge for merge in merges}


def check_kept(trainable: Iterable[str], lost: Iterable[str], how: str) -> None:
    """Refuses an export that would leave out tensors the run trained, naming them."""
    dropped = sorted(set(trainable) & set(lost))
    if dropped:
        shown = ", ".join(dropped[:8]) + (f" (and {len(dropped) - 8} more)" if len(dropped) > 8 else "")
        raise PipelineConfigError(f"these trained tensors would be lost: {shown}; {how}.")


def _merge(
    state: Mapping[str, torch.Tensor],
    site: AdapterSite,
    adapter: str,
    module: str,
    pair: dict[str, str],
    wrapper: Mapping[str, Any] | None,
) -> LoraMerge:
    from peft.utils.other import get_pattern_key

    weight, config = wrapper["weight"] if wrapper else f"{module}.base_layer.weight", site.configs[adapter]
    if set(pair) != {"lora_A", "lora_B"} or weight not in state:
        raise PipelineConfigError(
            f"cannot merge adapter {adapter!r} at {module}: the checkpoint lacks"
            f" {', '.join(sorted({'lora_A', 'lora_B'} - set(pair))) or weight}."
        )
    a, b, w = state[pair["lora_A"]], state[pair["lora_B"]], state[weight]
    experts = wrapper["experts"] if wrapper and w.dim() == 3 else 0
    swapped = bool(wrapper and wrapper["swapped"])
    if experts:  # peft's in and out are the stack's last two dimensions, swapped where it keeps (out, in)
        product = (experts, b.shape[0], a.shape[-1]) if swapped else (experts, a.shape[-1], b.shape[0])
    else:
        product = (b.shape[0], a.shape[-1])[:: -1 if config["fan_in_fan_out"] else 1]
    if a.dim() != 2 or b.dim() != 2 or tuple(w.shape) != product:
        raise PipelineConfigError(
            f"cannot merge adapter {adapter!r} at {module}: lora_A {list(a.shape)}, lora_B {list(b.shape)} and the"
            f" base weight {list(w.shape)} are not a LoRA of a Linear or of a stack of experts. Export it with"
            " --format peft."
        )
    key = module[len(site.prefix) :]  # as peft matched it in the base model
    rank = config["rank_pattern"].get(get_pattern_key(config["rank_pattern"].keys(), key), config["r"])
    alpha = config["alpha_pattern"].get(get_pattern_key(config["alpha_pattern"].keys(), key), config["lora_alpha"])
    if rank * max(experts, 1) != a.shape[0]:
        raise PipelineConfigError(f"adapter {adapter!r} at {module}: lora_A has rank {a.shape[0]}, its config {rank}.")
    scaling = alpha / math.sqrt(rank) if config["use_rslora"] else alpha / rank
    return LoraMerge(weight, pair["lora_A"], pair["lora_B"], scaling, bool(config["fan_in_fan_out"]), experts, swapped)


def _jsonable(value: Any) -> Any:
    """peft's config values as JSON (sets sorted into lists, enums as their values), as its ``save_pretrained``."""
    if isinstance(value, enum.Enum):
        return value.value
    if isinstance(value, Mapping):
        return {str(k): _jsonable(v) for k, v in value.items()}
    if isinstance(value, (set, frozenset)):
        return sorted(_jsonable(v) for v in value)
    if isinstance(value, (list, tuple)):
        return [_jsonable(v) for v in value]
    return value
