"""peft's layers as a trace on meta can record them, in the skeleton the tracer traces (never the user's module).

Two of peft's forwards cannot be traced there. A ``ParamWrapper`` (``target_parameters``: LoRA on a tensor rather
than a module) adds its adapters' product to the tensor as a parametrization for the call, folding one adapter's
factors in under ``torch.autocast`` of the tensor's device, which meta has none of ("unsupported scalarType"): it
traces as the fold itself and the wrapped module called on the folded tensors. DoRA's magnitude module is called
with its layer's ``lora_A`` and ``lora_B`` and calls them, which torch's unflattening refuses (a module called
inside another that does not hold it): it is traced as part of its layer, which holds all three. Either way the
graph computes what peft's forward computes, so the pieces train, compile and are counted as the rest.
"""

from __future__ import annotations

from collections.abc import Iterable
from typing import Any

import torch
from torch import nn

from lightning_pp.checkpoints.adapters import BASE_LAYER, is_parameter_wrapper


def adapted_tensors(wrapper: nn.Module) -> tuple[nn.Module, dict[str, torch.Tensor]] | None:
    """The module peft's nested wrappers (outermost ``wrapper``) adapt, and each adapted tensor as peft's forward
    makes it for the call (its ``_activate_lora``: one adapter's factors folded in by ``baddbmm``, else the sum of
    its adapters' ``get_delta_weight``), without the parametrization peft registers. None where peft adds otherwise
    (a float8 tensor, upcast; adapters merged or turned off): peft's module runs there."""
    from peft.utils import UPCAST_DTYPES

    tensors, m = {}, wrapper
    while is_parameter_wrapper(m):
        w = m.get_param()
        if m.merged or m.disable_adapters or any(getattr(torch, d, None) == w.dtype for d in UPCAST_DTYPES):
            return None
        adapters = [a for a in m.active_adapters if a in m.lora_A]
        if len(adapters) == 1 and m.num_experts > 1 and hasattr(m, "get_delta_factors"):
            lhs, rhs, scaling = m.get_delta_factors(adapters[0])
            tensors[m.parameter_name] = torch.baddbmm(w, lhs, rhs, alpha=scaling)
        else:
            tensors[m.parameter_name] = w + sum(m.get_delta_weight(a) for a in adapters) if adapters else w
        m = m.base_layer
    return m, tensors


def _folded_forward(self: nn.Module, *args: Any, **kwargs: Any) -> Any:
    found = adapted_tensors(self)
    if found is None:
        return type(self).forward(self, *args, **kwargs)
    module, tensors = found
    return torch.func.functional_call(module, tensors, args, kwargs, strict=False)


_INLINED: dict[type, type] = {}


def _inline(module: nn.Module) -> None:
    """``module``'s calls run its forward without a module call of their own, as code of the module calling it."""
    cls = type(module)
    if cls not in _INLINED:
        _INLINED[cls] = type(cls.__name__, (cls,), {"__call__": lambda self, *a, **k: self.forward(*a, **k)})
    module.__class__ = _INLINED[cls]


def traceable_adapters(skeleton: nn.Module, opaque: Iterable[str] = ()) -> None:
    """peft's parameter wrappers in ``skeleton`` (but those at or inside ``opaque``, recorded as an op of their own)
    trace as their fold; DoRA's magnitude modules as code of their layer."""
    outermost = list(opaque)
    for name, m in skeleton.named_modules():
        if is_parameter_wrapper(m) and not any(name == o or name.startswith(o + BASE_LAYER) for o in outermost):
            outermost.append(name)
            m.forward = _folded_forward.__get__(m)  # type: ignore[method-assign]
        for magnitude in getattr(m, "lora_magnitude_vector", {}).values():
            _inline(magnitude)


def untraced_adapters_fix(model: nn.Module) -> str:
    """What to change when a trace of ``model`` failed and it holds peft adapters of a kind other than LoRA's
    (DoRA, AdaLoRA and LoRA on tensors included) and IA3's, the kinds whose traces are tested against one process;
    empty where it holds none. LoHa, LoKr and VeRA were seen to fail (a guard on a value only data decides; VeRA's
    matrices shared by every layer)."""
    try:
        from peft.tuners.ia3 import IA3Layer
        from peft.tuners.lora import LoraLayer
        from peft.tuners.tuners_utils import BaseTunerLayer
    except ImportError:
        return ""
    other: dict[str, str] = {}
    for name, m in model.named_modules():
        if isinstance(m, BaseTunerLayer) and not isinstance(m, (LoraLayer, IA3Layer)):
            path = type(m).__module__.split(".")  # peft.tuners.<kind>.layer
            other.setdefault(path[2] if len(path) > 2 else type(m).__name__, name)
    if not other:
        return ""
    kinds = ", ".join(f"{kind} at {name}" for kind, name in other.items())
    return f"Its peft adapters ({kinds}) are of a kind that does not trace here: train LoRA (or DoRA, AdaLoRA, IA3)"
