"""Split backward (zero-bubble and V schedules) exact for stages behind frozen parts.

torch's split backward computes a stage's input gradients first (``stage_backward_input``) and its weight
gradients later from what that pass kept: the autograd nodes where each weight's path meets the input's
path. A weight whose path never meets the input's gets no gradient. torch falls back to a full backward in
the weight pass for stage 0 only (its input is data); a later stage whose received input carries no gradient
(everything before it frozen: a fine-tune with frozen embeddings and leading blocks, adapters on the later
layers only) computed no weight gradients at all under ``zbv``/``interleaved_zb`` and wrong ones under
``dualpipev``, with no error. Here such a stage defers a full backward to its weight pass, as torch does for
stage 0; a stage whose input does need gradients but some trainable weight's path does not meet it (found
once, on its first split backward) runs the full backward in its input pass. Stages whose weights all meet
their input keep torch's split unchanged, on torch >= 2.13: before it, torch's weight pass is not exact on every
graph (``compat.weight_pass_exact``), and every stage runs the full backward in its input pass, said once.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import torch
from lightning.pytorch.utilities.rank_zero import rank_zero_info
from torch.distributed.pipelining import PipelineStage
from torch.distributed.pipelining._backward import _get_grad_fn_or_grad_acc, construct_reverse_graph, get_param_groups

from lightning_pp.compat import weight_pass_exact


@dataclass
class _Deferred:
    """What the weight pass needs for the full backward the input pass left to it (in place of torch's groups)."""

    stage_output: Any
    output_grads: Any
    input_values: list[Any]


def exact_split_backward(stage: PipelineStage) -> PipelineStage:
    """``stage`` whose split backward gives every trainable weight its gradient (see the module's docstring)."""
    backward = stage.backward_maybe_with_nosync
    full_in_input_pass: list[bool] = []  # decided at the stage's first split backward whose input needs gradients

    def split_exactly(backward_type: str, bwd_kwargs: dict, last_backward: bool = False) -> Any:
        if backward_type == "input":
            inputs = bwd_kwargs["input_values"]
            if not any(isinstance(t, torch.Tensor) and t.requires_grad for t in inputs):
                output, grads = _full_backward_arguments(bwd_kwargs)
                return tuple(None for _ in inputs), _Deferred(output, grads, inputs)
            if not full_in_input_pass:
                full_in_input_pass.append(not _weight_pass_exact() or _has_orphan_weights(stage, bwd_kwargs))
            if full_in_input_pass[0]:
                output, grads = _full_backward_arguments(bwd_kwargs)
                full = {"stage_output": output, "output_grads": grads, "input_values": inputs}
                return backward("full", full, last_backward)[0], []  # no groups: the weight pass has nothing left
        if backward_type == "weight" and isinstance(bwd_kwargs["param_groups"], _Deferred):
            deferred: _Deferred = bwd_kwargs["param_groups"]
            full = {"stage_output": deferred.stage_output, "output_grads": deferred.output_grads,
                    "input_values": deferred.input_values}  # fmt: skip
            return backward("full", full, last_backward)
        return backward(backward_type, bwd_kwargs, last_backward)

    stage.backward_maybe_with_nosync = split_exactly  # type: ignore[method-assign]
    return stage


_SAID: list[bool] = []


def _weight_pass_exact() -> bool:
    """``compat.weight_pass_exact``, said once per process (rank 0) where it is not."""
    exact = weight_pass_exact()
    if not exact and not _SAID:
        _SAID.append(True)
        rank_zero_info(
            f"torch {torch.__version__}'s split backward (zero-bubble and V schedules) computes some weight gradients"
            " wrongly (fixed in torch 2.13): each stage runs its whole backward where the schedule runs the input's,"
            " so training equals one process, without the overlap of weight gradients the schedule is for. torch"
            " >= 2.13 splits it."
        )
    return exact


def _full_backward_arguments(bwd_kwargs: dict) -> tuple[Any, Any]:
    """The output (or loss) and its gradients as torch's full backward takes them: the last stage's loss alone,
    not the one-tuple the input pass wraps it in (a tuple with no gradients would back-propagate nothing)."""
    output, grads = bwd_kwargs["stage_output"], bwd_kwargs["output_grads"]
    if grads is None and isinstance(output, (tuple, list)) and len(output) == 1:
        return output[0], None
    return output, grads


def _has_orphan_weights(stage: PipelineStage, bwd_kwargs: dict) -> bool:
    """Whether a trainable weight the output depends on is missing from the groups torch's input pass would keep."""
    output = bwd_kwargs["stage_output"]
    outputs = [t for t in (output if isinstance(output, (tuple, list)) else [output]) if isinstance(t, torch.Tensor)]
    roots = [fn for fn in map(_get_grad_fn_or_grad_acc, outputs) if fn is not None]
    inputs = [_get_grad_fn_or_grad_acc(t) for t in bwd_kwargs["input_values"] if isinstance(t, torch.Tensor)]
    weights = [_get_grad_fn_or_grad_acc(p) for p in stage.submod.parameters() if p.requires_grad]
    reverse = construct_reverse_graph(roots)
    used = {w for w in weights if w in reverse or w in roots}
    grouped = set().union(*(g["params"] for g in get_param_groups([i for i in inputs if i], list(used), reverse)))
    return bool(used - grouped)
