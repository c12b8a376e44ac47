"""Where peft put adapters inside a LightningModule, and the names its tensors have in and out of it.

A LightningModule holds a peft model at an attribute (``self.model = get_peft_model(hf, config)``) or had
adapters injected into a module of its own (``inject_adapter_in_model``). Either way the frozen base keeps
its tensors under new names (``...q_proj.base_layer.weight``) and each adapter adds tensors named after it
(``...q_proj.lora_A.default.weight``). Three other namings meet these: the base model's own (what a
pretrained checkpoint and a merged export hold), and peft's adapter file (``adapter_model.safetensors``:
names under ``base_model.model.``, without the adapter's name). Every conversion between them is here, once.
"""

from __future__ import annotations

import re
from collections.abc import Iterator
from dataclasses import dataclass
from typing import Any, Optional

from torch import nn

PEFT_FILE_PREFIX = "base_model.model."  # what peft's adapter files put ahead of the base model's names
ADAPTER_CONFIG = "adapter_config.json"  # what PeftModel.save_pretrained writes into an adapter directory
ADAPTER_WEIGHTS = "adapter_model.safetensors"
BASE_LAYER = ".base_layer"  # peft's step into the module a wrapper wraps
_ORIGINAL = ".original_module"  # in peft's ModulesToSaveWrapper: the module it wraps, frozen
_MAGNITUDE = ".lora_magnitude_vector"  # DoRA's, one module per adapter
_COPIES = ".modules_to_save"  # and each adapter's trained copy of it, at modules_to_save.<adapter>
# peft's steps into the module it wraps; LoRA on two parameters of one module nests two (experts.base_layer.base_layer)
_WRAPPED = re.compile(rf"(?:{re.escape(BASE_LAYER)}|{re.escape(_ORIGINAL)})+\.")


@dataclass(frozen=True)
class AdapterSite:
    """One peft model (or model with injected adapters) inside the LightningModule."""

    prefix: str  # qualified name of the base model inside the LightningModule, with a trailing dot ("" at the root)
    configs: dict[str, Any]  # adapter name -> its peft config object
    holder: str  # qualified name of the module holding ``peft_config`` (the PeftModel or the injected model)

    def base_key(self, name: str) -> Optional[str]:
        """``name`` (a tensor of the LightningModule) as the base model names it: peft's ``.base_layer`` and
        ``.original_module`` steps out, and a ``modules_to_save`` copy named as the module it copies (peft starts
        it as that module's copy). None for LoRA's own tensors and tensors outside this site."""
        if not name.startswith(self.prefix) or (self.adapter_of(name) is not None and not self.is_copy(name)):
            return None
        rest = name[len(self.prefix) :]
        if self.is_copy(name):
            rest = rest.replace(f"{_COPIES}.{self.adapter_of(name)}.", ".", 1)
        return _WRAPPED.sub(".", rest)

    def adapter_of(self, name: str) -> Optional[str]:
        """The adapter a tensor belongs to (``"default"``): LoRA's tensors and the adapter's ``modules_to_save``
        copy; None for base tensors."""
        if not name.startswith(self.prefix):
            return None
        parts = name[len(self.prefix) :].split(".")
        for i, part in enumerate(parts[:-1]):
            if (part.startswith("lora_") or part == _COPIES[1:]) and parts[i + 1] in self.configs:
                return parts[i + 1]
        return None

    def is_copy(self, name: str) -> bool:
        """Whether ``name`` is in an adapter's ``modules_to_save`` copy of a module (a classifier head that trains
        whole beside LoRA: ``task_type="SEQ_CLS"`` adds it by itself)."""
        adapter = self.adapter_of(name)
        return adapter is not None and f"{_COPIES}.{adapter}." in name[len(self.prefix) :]

    def peft_key(self, name: str) -> Optional[str]:
        """``name`` as peft's adapter file names it (``base_model.model.<base names>``, the adapter's name out; a
        ``modules_to_save`` copy under the name of the module it copies), by peft's rules: the adapter's name is the
        last step of a parameter (``lora_embedding_A.default``) or the one before a module's tensor
        (``lora_A.default.weight``), and DoRA's magnitude keeps the name it had as a parameter
        (``lora_magnitude_vector``, no ``.weight``)."""
        adapter = self.adapter_of(name)
        if adapter is None:
            return None
        if self.is_copy(name):
            return PEFT_FILE_PREFIX + str(self.base_key(name))
        rest = name[len(self.prefix) :]
        if rest.endswith(f"{_MAGNITUDE}.{adapter}.weight"):
            rest = rest.removesuffix(".weight")
        if rest.endswith(f".{adapter}"):
            return PEFT_FILE_PREFIX + rest[: -len(adapter) - 1]
        module, _, tensor = rest.rpartition(".")
        return PEFT_FILE_PREFIX + module.removesuffix(f".{adapter}") + "." + tensor


def adapter_sites(module: nn.Module) -> list[AdapterSite]:
    """Every peft model and every module with injected adapters inside ``module`` (outermost first)."""
    sites: list[AdapterSite] = []
    for name, m in _named_modules(module):
        configs = getattr(m, "peft_config", None)
        if not isinstance(configs, dict) or not configs or any(s.holder and name.startswith(s.holder) for s in sites):
            continue
        holder = f"{name}." if name else ""
        base = getattr(getattr(m, "base_model", None), "model", None)
        if base is not None and type(m).__name__.startswith("Peft"):  # PeftModel -> LoraModel -> the base model
            sites.append(AdapterSite(f"{holder}base_model.model.", dict(configs), holder))
        else:
            sites.append(AdapterSite(holder, dict(configs), holder))
    return sites


def is_parameter_wrapper(m: nn.Module) -> bool:
    """peft's ``ParamWrapper``: LoRA on one tensor of the module it wraps (nested, one per tensor)."""
    return isinstance(getattr(m, "parameter_name", None), str) and hasattr(m, "lora_A")


def parameter_wrappers(module: nn.Module) -> dict[str, dict[str, Any]]:
    """peft's LoRA on parameters rather than modules (``target_parameters``, its ``ParamWrapper``: an MoE's stacked
    experts weights), by the wrapper's name: the tensor it adapts (nested wrappers, one per parameter of a module,
    step down ``.base_layer`` to it), its experts (the first dimension of a 3-d stack; 1 for a matrix) and whether
    peft swapped in and out (a stack stored (experts, out, in)). The merged export cannot tell these from names."""
    found: dict[str, dict[str, Any]] = {}
    for name, m in _named_modules(module):
        if not is_parameter_wrapper(m):
            continue
        base, path = m.base_layer, f"{name}{BASE_LAYER}"
        while is_parameter_wrapper(base):
            base, path = base.base_layer, f"{path}{BASE_LAYER}"
        found[name] = {
            "weight": f"{path}.{m.parameter_name}",
            "experts": int(m.num_experts),
            "swapped": bool(m._did_swap_in_out_features),
        }
    return found


def site_of(sites: list[AdapterSite], name: str) -> Optional[AdapterSite]:
    """The site a tensor name lies in (the innermost prefix that holds it)."""
    inside = [s for s in sites if name.startswith(s.prefix)]
    return max(inside, key=lambda s: len(s.prefix)) if inside else None


def _named_modules(module: nn.Module) -> Iterator[tuple[str, nn.Module]]:
    """Named modules, skipping ``None`` children (a pruned stage)."""
    for name, m in module.named_modules():
        if m is not None:
            yield name, m
