"""One stage of the model run for generation: the module's own forward in Hugging Face's calling convention
(``input_ids``, ``attention_mask``, ``position_ids``, ``past_key_values``, ``use_cache``), on the stage's view.

The stage's first layer takes the previous stage's hidden state in place of what the parts before it computed
(a forward pre-hook), a stage that is not the last hands on its last layer's output (a forward hook that stops
the forward there); the parts another stage holds that the forward still calls before this stage's layers are
stand-ins (a position embedding whose sum the received hidden state replaces anyway), and parts without
parameters (rotary embeddings, dropout) are the rank's own copies of them. So a stage's layers see what they
would see in the whole model, which every prefill checks: the tensors the layers receive beside the hidden state
(position embeddings, masks) are compared with the first stage's, and a stage that computes others is refused.

Each stage keeps one cache per micro-batch lane, transformers' ``DynamicCache`` holding only this stage's layers:
the other layers' slots are aliases of the stage's first layer of their kind, so that the cache's length and mask
sizes (read at layer 0) are the stage's own.
"""

from __future__ import annotations

import contextlib
import inspect
from collections.abc import Iterator
from typing import Any

import torch
from torch import nn

from lightning_pp.errors import PipelineConfigError
from lightning_pp.layout.mesh import batch_fingerprint
from lightning_pp.split.stage import Placement, find_layers, get_path, model_entries

CACHE_ARGUMENTS = ("past_key_values", "past_key_value")


class _Handoff(BaseException):
    """Stops a stage's forward after its last layer (BaseException: a broad ``except Exception`` keeps out)."""

    def __init__(self, hidden: torch.Tensor) -> None:
        super().__init__()
        self.hidden = hidden


def generation_entry(module: nn.Module, layers_path: str) -> str:
    """The outermost module on the way to the layers whose forward takes ``past_key_values``: Hugging Face's
    ``...ForCausalLM`` (under peft too), or the user's module that passes a cache to its layers."""
    entries = model_entries(module, layers_path)
    for path, entry in entries.items():
        if path != layers_path and "past_key_values" in inspect.signature(type(entry).forward).parameters:
            return path
    names = [f"{p or 'the module'} ({type(e).__name__})" for p, e in entries.items()]
    raise PipelineConfigError(
        f"generate needs a model whose forward takes a key/value cache: none of {names[:-1]} has a"
        " `past_key_values` argument. A Hugging Face causal LM has one; a module of your own takes"
        " `forward(input_ids, attention_mask=None, position_ids=None, past_key_values=None, use_cache=False)`, passes"
        " the cache to each layer, which calls `past_key_values.update(k, v, i)` with i its position in the layers."
    )


def check_generates(module: nn.Module, layers_path: str) -> None:
    """What generation needs of a model, checked on every rank alike: a forward and layers that take a cache."""
    generation_entry(module, layers_path)
    for key, layer in find_layers(module, layers_path).items():
        parameters = inspect.signature(type(layer).forward).parameters
        if not any(name in parameters for name in CACHE_ARGUMENTS):
            raise PipelineConfigError(
                f"generate needs layers that keep a key/value cache, and layer {key!r} of '{layers_path}'"
                f" ({type(layer).__name__}) takes none (its forward has no `past_key_values` argument): each token"
                " would recompute the whole sequence without it. Give the layer a `past_key_values` argument and"
                " call `past_key_values.update(k, v, i)` on it (i: its position in the layers), as Hugging Face's do."
            )


def call_entry(entry: nn.Module, ids: torch.Tensor, **given: Any) -> Any:
    """``entry`` on ``ids`` with those of the ``given`` keywords its forward names (``input_ids=`` where it has one)."""
    names = inspect.signature(type(entry).forward).parameters
    kwargs = {k: v for k, v in given.items() if k in names}
    return entry(input_ids=ids, **kwargs) if "input_ids" in names else entry(ids, **kwargs)


class StageCall:
    """This rank's stage ``stage`` of the model, called once per lane and step."""

    def __init__(
        self, view: nn.Module, placement: Placement, stage: int, spares: dict[str, nn.Module], device: torch.device
    ) -> None:
        self.stage, self.is_last = stage, stage == placement.n_stages - 1
        self.view = view
        self.entry = get_path(view, generation_entry(view, placement.layers_path))
        keys = placement.layers_of(stage)
        layers = find_layers(view, placement.layers_path)
        self.first, self.last = layers[keys[0]], layers[keys[-1]]
        self.positions = [placement.layer_keys.index(k) for k in keys]
        self.n_layers = len(placement.layer_keys)
        absent = placement.absent_on(stage)
        self.spares = {name: spares[name].to(device) for name in absent if name in spares}
        self.absent = [n for n in absent if n not in spares]
        self.caches: dict[int, Any] = {}
        self.received: torch.Tensor | None = None
        self.recording = False
        self.seen: torch.Tensor | None = None  # the fingerprint of the layers' other inputs at the last prefill

    def new_cache(self) -> Any:
        """A cache for one lane with slots for every layer, holding tensors for this stage's only."""
        try:
            from transformers import DynamicCache
            from transformers.cache_utils import DynamicLayer
        except ImportError as error:  # pragma: no cover
            raise PipelineConfigError("generate keeps transformers' caches: pip install transformers") from error
        config = getattr(self.entry, "config", None)
        cache = DynamicCache(config=config) if config is not None else DynamicCache()
        while len(cache.layers) < self.n_layers:
            cache.layers.append(DynamicLayer())
        for i in range(self.n_layers):
            if i not in self.positions:
                kind = [p for p in self.positions if type(cache.layers[p]) is type(cache.layers[i])]
                cache.layers[i] = cache.layers[(kind or self.positions)[0]]
        return cache

    def cache_bytes(self) -> int:
        """What this stage's caches hold now (its layers' keys and values)."""
        held = {id(c.layers[p]): c.layers[p] for c in self.caches.values() for p in self.positions}
        return sum(
            t.nbytes
            for layer in held.values()
            for t in (getattr(layer, "keys", None), getattr(layer, "values", None))
            if isinstance(t, torch.Tensor)
        )

    def __call__(
        self,
        lane: int,
        ids: torch.Tensor,
        mask: torch.Tensor | None,
        positions: torch.Tensor,
        received: torch.Tensor | None,
        record: bool = False,
    ) -> torch.Tensor:
        """The hidden state this stage hands on, or on the last stage the logits of each row's last token."""
        if lane not in self.caches:
            self.caches[lane] = self.new_cache()
        given = {
            "attention_mask": mask,
            "position_ids": positions,
            "past_key_values": self.caches[lane],
            "use_cache": True,
            "logits_to_keep": 1,
        }
        self.received, self.recording = received, record
        with self._parts(received):
            try:
                out = call_entry(self.entry, ids, **given)
            except _Handoff as handoff:
                return handoff.hidden
            finally:
                self.received = None
        if not self.is_last:
            raise PipelineConfigError(
                f"stage {self.stage}'s forward returned without running its last layer; generate runs the model"
                " that the layers belong to, from its first part to its last."
            )
        logits = getattr(out, "logits", out[0] if isinstance(out, tuple) else out)
        return logits[:, -1]

    @contextlib.contextmanager
    def _parts(self, received: torch.Tensor | None) -> Iterator[None]:
        """The hooks on the stage's first and last layer, the spare parts and stand-ins in place."""
        handles = [self.first.register_forward_pre_hook(self._take_received, with_kwargs=True)]
        if not self.is_last:
            handles.append(self.last.register_forward_hook(self._hand_on))
        placed: list[tuple[nn.Module, str, Any]] = []
        try:
            for name, part in self.spares.items():
                placed.append(_place(self.view, name, part))
            if received is not None:
                for name in self.absent:
                    placed.append(_place(self.view, name, _StandIn(received)))
            yield
        finally:
            for handle in handles:
                handle.remove()
            for parent, attr, before in reversed(placed):
                setattr(parent, attr, before)

    def _take_received(self, layer: nn.Module, args: tuple, kwargs: dict) -> tuple[tuple, dict] | None:
        if self.recording:  # a prefill: what the layers receive beside the hidden state, for the check
            self.seen = batch_fingerprint((args[1:], kwargs))
            self.recording = False
        if self.received is None:
            return None
        if args:
            return (self.received, *args[1:]), kwargs
        name = next(n for n in inspect.signature(type(layer).forward).parameters if n != "self")
        return args, {**kwargs, name: self.received}

    def _hand_on(self, layer: nn.Module, args: tuple, out: Any) -> None:
        hidden = out[0] if isinstance(out, tuple) else out
        raise _Handoff(hidden.contiguous())


class _StandIn(nn.Module):
    """A part another stage holds, called before this stage's layers: its output is overwritten by the hidden
    state this stage receives (checked through the layers' other inputs)."""

    def __init__(self, like: torch.Tensor) -> None:
        super().__init__()
        self.like = like

    def forward(self, *args: Any, **kwargs: Any) -> torch.Tensor:
        return torch.zeros_like(self.like)


def _place(view: nn.Module, name: str, part: nn.Module) -> tuple[nn.Module, str, Any]:
    parent_name, _, attr = name.rpartition(".")
    parent = get_path(view, parent_name)
    before = getattr(parent, attr, None)
    setattr(parent, attr, part)
    return parent, attr, before
