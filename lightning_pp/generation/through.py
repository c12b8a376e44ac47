"""``PipelineStrategy.generate``: the checks every rank makes before any message, then the ring.

Generation runs the stages in eval mode without gradients, eagerly (compiled layers would recompile for every
length), inside the precision plugin's forward context; FSDP-sharded stages are unsharded for the call (each
replica then generates its own prompts without a collective) and resharded after. Nothing of the training state
changes: the caches live for the call, sampling draws from its own generator.
"""

from __future__ import annotations

import contextlib
import contextvars
from collections.abc import Callable, Iterable, Iterator
from typing import Any

import torch
from torch import nn

from lightning_pp.errors import PipelineConfigError
from lightning_pp.generation.ring import GenerationReport, Ring, generate
from lightning_pp.generation.sampling import Sampling
from lightning_pp.generation.stages import StageCall, call_entry, check_generates, generation_entry
from lightning_pp.holding.stages import Holding
from lightning_pp.layout.mesh import Layout, check_same_batch
from lightning_pp.layout.options import PipelineOptions
from lightning_pp.split.stage import Placement, get_path, model_entries, resolve_layers, running_stages


def generate_through(
    module: Any,
    holding: Holding,
    placement: Placement | None,
    options: PipelineOptions,
    layout: Layout,
    group: Any,
    device: torch.device,
    wire: torch.device,
    forward_context: Any,
    input_ids: torch.Tensor,
    attention_mask: torch.Tensor | None,
    sampling: dict[str, Any],
) -> tuple[torch.Tensor, GenerationReport]:
    """Every row's prompt and its new tokens, on every rank of this rank's pipeline."""
    views, spares, roots = holding.views, holding.spares, holding.roots
    chosen = Sampling(**sampling)
    input_ids, attention_mask = _check_inputs(input_ids, attention_mask, device)
    _refuse(options)
    if views is None or placement is None:
        if _LEARNING.get():  # the stages are being learned from this very call: the model's own call, captured
            _call_whole(module, options.layers, input_ids, attention_mask)
        raise StagesNotBuilt(
            "generate cannot run here: the stages are not built yet. Call it after trainer.fit, validate, test or"
            " predict ran a batch, or from a predict_step (its first batch builds them)."
        )
    assert views is not None and placement is not None
    check_generates(next(iter(views.values())), placement.layers_path)
    calls = {s: StageCall(view, placement, s, spares, device) for s, view in views.items()}
    check_same_batch((input_ids, attention_mask), group)  # every stage of a pipeline generates the same prompts
    ring = Ring(calls, placement.n_stages, layout.stage_rank, layout.rank, group, device, wire)
    token = _GENERATING.set(True)
    try:
        with _inference([*views.values(), *roots.values()], options), forward_context, running_stages():
            return generate(ring, input_ids, attention_mask, chosen)
    finally:
        _GENERATING.reset(token)


def _check_inputs(
    input_ids: Any, attention_mask: Any, device: torch.device
) -> tuple[torch.Tensor, torch.Tensor]:
    if not isinstance(input_ids, torch.Tensor) or input_ids.ndim != 2 or input_ids.is_floating_point():
        shape = tuple(input_ids.shape) if isinstance(input_ids, torch.Tensor) else type(input_ids).__name__
        raise PipelineConfigError(
            f"generate(input_ids=...) takes a (rows, positions) tensor of token ids, not {shape}; left-pad prompts of"
            " different lengths and pass their attention_mask."
        )
    if attention_mask is None:
        attention_mask = torch.ones_like(input_ids)
    if not isinstance(attention_mask, torch.Tensor) or attention_mask.shape != input_ids.shape:
        got = tuple(attention_mask.shape) if isinstance(attention_mask, torch.Tensor) else attention_mask
        raise PipelineConfigError(
            f"generate(attention_mask=...) must have input_ids' shape {tuple(input_ids.shape)}, not {got}."
        )
    if bool((attention_mask[:, -1] == 0).any()):
        raise PipelineConfigError(
            "generate's prompts are right-padded (a row's last attention_mask entry is 0): new tokens would follow the"
            " padding. Pad on the left (tokenizer.padding_side = 'left'), as Hugging Face's generate expects."
        )
    return input_ids.to(device), attention_mask.to(device)


def _refuse(options: PipelineOptions) -> None:
    reasons = [
        (options.schedule == "2bw", "schedule='2bw' keeps weight versions generate would have to pick between"),
        (options.tensor_parallel_size > 1, "tensor_parallel_size > 1 (each layer a collective per token)"),
        (options.expert_parallel_size > 1, "expert_parallel_size > 1 (experts exchanged by all-to-all per token)"),
    ]  # fmt: skip
    for refused, why in reasons:
        if refused:
            raise PipelineConfigError(f"generate cannot run here: {why}.")


@contextlib.contextmanager
def _inference(modules: list[nn.Module], options: PipelineOptions) -> Iterator[None]:
    """Eval mode, no gradients, eager; FSDP's units unsharded for the call, as they were after."""
    from torch.distributed.fsdp import FSDPModule

    modes = {m: m.training for module in modules for m in module.modules()}
    units = [m for module in modules for m in module.modules() if isinstance(m, FSDPModule)]
    try:
        for module in modules:
            module.eval()
        for unit in units:
            unit.unshard()
            unit.set_reshard_after_forward(False, recurse=False)
        with torch.no_grad(), torch.compiler.set_stance("force_eager"):
            yield
    finally:
        for unit in units:
            unit.set_reshard_after_forward(options.fsdp_reshard == "microbatch", recurse=False)
            unit.reshard()
        for m, training in modes.items():
            m.training = training


NOT_GENERATION = object()
_GENERATING: contextvars.ContextVar[bool] = contextvars.ContextVar("lightning_pp_generating", default=False)
_LEARNING: contextvars.ContextVar[bool] = contextvars.ContextVar("lightning_pp_learning_stages", default=False)


class StagesNotBuilt(PipelineConfigError):
    """``generate`` before any batch built this rank's stages."""


def _call_whole(module: nn.Module, layers: str | None, input_ids: torch.Tensor, mask: torch.Tensor) -> None:
    """The generation's model call on the whole module, which the placement learner captures (never runs)."""
    entry = get_path(module, generation_entry(module, resolve_layers(module, layers)))
    call_entry(entry, input_ids, attention_mask=mask)


class _ModelCalled(BaseException):
    """The step called the model itself: a step for the pipeline, not a generation step."""


def generation_step(
    module: Any, placement: Placement | None, layers: str | None, args: tuple, kwargs: dict, build: Callable[..., Any]
) -> Any:
    """A ``predict_step`` that calls ``strategy.generate`` (and not the model) run on every rank as it is, its
    result returned; ``NOT_GENERATION`` for a step that calls the model, which the pipeline then runs (the step
    ran up to its model call here). Before any batch, ``build("predict_step", args, kwargs)`` makes the stages
    from the step's generation (the checkpoint of ``ckpt_path`` read then), and the step runs again."""
    try:
        path = placement.layers_path if placement is not None else resolve_layers(module, layers)
    except PipelineConfigError:  # the pipeline's own checks say why, with the step's batch
        return NOT_GENERATION
    try:
        with _model_calls_stopped(model_entries(module, path).values()):
            return module.predict_step(*args, **kwargs)
    except _ModelCalled:
        return NOT_GENERATION
    except StagesNotBuilt:
        token = _LEARNING.set(True)
        try:
            build("predict_step", args, kwargs)
        finally:
            _LEARNING.reset(token)
    return module.predict_step(*args, **kwargs)


@contextlib.contextmanager
def _model_calls_stopped(entries: Iterable[nn.Module]) -> Iterator[None]:
    """A call of the model outside ``generate`` raises ``_ModelCalled`` (before the pruned module's own guard)."""
    handles = [entry.register_forward_pre_hook(_stop_outside_generate, prepend=True) for entry in entries]
    try:
        yield
    finally:
        for handle in handles:
            handle.remove()


def _stop_outside_generate(*_: Any) -> None:
    if not _GENERATING.get():
        raise _ModelCalled()
