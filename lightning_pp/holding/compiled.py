"""``compile=True``: each layer of the rank's stages compiled in place, once the stages exist on the device.

``layer.compile()`` (``nn.Module.compile``) leaves the module where it is, so parameter names, state-dict keys,
hooks and checkpoints stay the one-process ones; torchtitan's ``apply_compile`` compiles each block the same way.
Identical blocks share one graph (dynamo takes their parameters as inputs). Under ``split="trace"`` the layers are
the modules each traced piece calls. A layer the user compiled already is left as it is.
"""

from __future__ import annotations

from collections.abc import Callable, Mapping
from typing import Any

from torch import nn

from lightning_pp.split.stage import is_compiled

Hook = Callable[[Mapping[str, nn.Module]], None]  # something done to each layer of a stage


def compile_layers(layers: Mapping[str, nn.Module | None], options: Mapping[str, Any]) -> None:
    """Compile each layer in place with ``torch.compile``'s ``options`` (``mode``, ``dynamic``, ...)."""
    for layer in layers.values():
        if layer is not None and not is_compiled(layer):
            layer.compile(**options)


def each_of(hooks: list[Hook]) -> Hook | None:
    """One hook doing each of ``hooks`` in turn (activation checkpointing, then compile); None for none."""
    if not hooks:
        return None

    def run(layers: Mapping[str, nn.Module]) -> None:
        for hook in hooks:
            hook(layers)

    return run
