"""``init_adapter=DIR``: the adapters start from a PEFT adapter directory, each rank reading its own tensors.

``PeftModel.save_pretrained(DIR)`` writes ``adapter_config.json`` (the adapter's kind, rank, alpha, target
modules) and ``adapter_model.safetensors`` (its tensors under peft's names, ``checkpoints.adapters``). At setup
every rank checks the config against the module's adapter and the file's keys against the module's adapter
tensors, so every rank fails alike before any collective; once a rank's stages exist it reads only their
tensors, through the reading ``init_weights`` uses (``checkpoints.pretrained``).
"""

from __future__ import annotations

import os
from pathlib import Path
from typing import Any

from lightning.pytorch.utilities.rank_zero import rank_zero_info
from torch import nn

from lightning_pp.checkpoints.adapters import ADAPTER_CONFIG, ADAPTER_WEIGHTS, AdapterSite, adapter_sites
from lightning_pp.checkpoints.pretrained import Pretrained, WeightMap, _few, open_pretrained
from lightning_pp.errors import PipelineConfigError

# what changes an adapter's tensors or what they compute: a difference is refused
_CHECKED = ("peft_type", "r", "lora_alpha", "target_modules", "use_rslora", "use_dora", "rank_pattern", "alpha_pattern")


def open_adapter(path: str | os.PathLike, module: nn.Module) -> tuple[Pretrained, WeightMap]:
    """The adapter directory at ``path`` checked against ``module``'s one peft adapter: its config, then which of
    the module's tensors each key of the file sets (names and shapes); no tensor is read."""
    path = Path(path).expanduser()
    if not (path / ADAPTER_CONFIG).is_file() or not (path / ADAPTER_WEIGHTS).is_file():
        raise PipelineConfigError(
            f"init_adapter={str(path)!r} is not a PEFT adapter directory: it needs {ADAPTER_CONFIG} and"
            f" {ADAPTER_WEIGHTS}, as PeftModel.save_pretrained(DIR) writes them"
            f" ({'nothing exists at that path' if not path.exists() else 'one or both are missing'})."
        )
    site, adapter = _only_adapter(module, path)
    _check_config(path, site.configs[adapter], adapter)
    pretrained = open_pretrained(path / ADAPTER_WEIGHTS)
    state = module.state_dict(keep_vars=True)
    own = [n for n in state if site.adapter_of(n) == adapter]
    keys = {n: k for n in own if (k := str(site.peft_key(n))) in pretrained.shapes}
    unknown = sorted(set(pretrained.shapes) - set(keys.values()))
    missing = [n for n in own if n not in keys]
    if unknown or missing:
        what = [f"{len(unknown)} tensors the module has not: {_few(unknown)}"] if unknown else []
        what += [f"no tensor for {len(missing)} of the module's: {_few(missing)}"] if missing else []
        raise PipelineConfigError(
            f"init_adapter={str(path)!r} does not fit adapter {adapter!r} of {type(module).__name__}: its"
            f" {ADAPTER_WEIGHTS} holds {'; and '.join(what)}. Build the module with the adapter's configuration"
            " (the same base model and target layers)."
        )
    wrong = [
        f"{n} {list(pretrained.shapes[k][0])} in the file, {list(state[n].shape)} in the module"
        for n, k in keys.items()
        if pretrained.shapes[k][0] != tuple(state[n].shape)
    ]
    if wrong:
        raise PipelineConfigError(f"init_adapter={str(path)!r}: shapes differ for {len(wrong)} tensors: {_few(wrong)}.")
    rank_zero_info(f"init_adapter: {len(keys)} tensors of adapter {adapter!r} from {path}")
    return pretrained, WeightMap(keys)


def _only_adapter(module: nn.Module, path: Path) -> tuple[AdapterSite, str]:
    """The one peft adapter ``module`` holds: an adapter directory holds one."""
    found = [(site, adapter) for site in adapter_sites(module) for adapter in site.configs]
    if len(found) != 1:
        held = ", ".join(f"{a!r} at '{s.holder or '<root>'}'" for s, a in found) or "none"
        raise PipelineConfigError(
            f"init_adapter={str(path)!r} starts one peft adapter, but {type(module).__name__} holds {len(found)}"
            f" ({held}). Wrap the model with peft (get_peft_model or inject_adapter_in_model) with one adapter."
        )
    return found[0]


def _check_config(path: Path, config: Any, adapter: str) -> None:
    from peft import PeftConfig

    saved = PeftConfig.from_pretrained(str(path))
    differ = [
        f"{field}={_plain(getattr(saved, field, None))!r} in {ADAPTER_CONFIG},"
        f" {_plain(getattr(config, field, None))!r} in the module"
        for field in _CHECKED
        if _plain(getattr(saved, field, None)) != _plain(getattr(config, field, None))
    ]
    if differ:
        raise PipelineConfigError(
            f"init_adapter={str(path)!r} holds another adapter than the module's {adapter!r}: {'; '.join(differ)}."
            " Build the module's peft config as the adapter was trained, or give the directory of this adapter."
        )


def _plain(value: Any) -> Any:
    """A config value as compared: an enum's value, a collection of names sorted."""
    value = getattr(value, "value", value)
    if isinstance(value, (set, frozenset, list, tuple)):
        return sorted(value)
    return value
