"""The inputs of torch's first-step shape inference, zeroed.

At a batch signature's first step torch runs each stage's forward once to learn its outputs' shapes, on inputs it
makes from the shapes alone with ``torch.empty``: a later stage's integer input is then whatever the memory held.
Models that hand on indices (GPT-J's ``position_ids``, which each layer gathers its rotary table with; token ids a
later stage embeds) index out of bounds there (CPU: ``index 140240962395504 is out of bounds``; CUDA: a device
assert). Zeros index in bounds and change no shape.
"""

from __future__ import annotations

from typing import Any

import torch
from torch.distributed.tensor import DTensor

from lightning_pp.compat import inference_inputs_left_uninitialised


def zeroed_inference_inputs(stage: Any) -> Any:
    """``stage`` (a ``PipelineStage``) whose shape inference runs on zeros where torch would leave memory as it was."""
    if not inference_inputs_left_uninitialised():
        return stage
    make = stage._to_tensor

    def zeroed(arg: Any) -> torch.Tensor:
        made = make(arg)
        if not isinstance(arg, torch.Tensor):  # made from a TensorMeta: torch.empty
            with torch.no_grad():
                (made._local_tensor if isinstance(made, DTensor) else made).zero_()
        return made

    stage._to_tensor = zeroed
    return stage
