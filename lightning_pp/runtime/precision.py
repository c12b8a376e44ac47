"""The Trainer's precision plugin under the pipeline: clipping by the whole model's norm, one loss scaler.

Lightning clips through the plugin's ``clip_grad_by_norm``, which sees only this rank's parameters:
each stage would clip by its own norm (silently wrong). FSDP and DeepSpeed override that method in
their own plugin classes; a pipeline accepts any precision, so it derives the same override from
whichever plugin class the Trainer chose.

Under ``16-mixed`` each rank's ``GradScaler`` would judge only its own stage's gradients: an
overflow in the gradient sent back across a stage boundary makes an early stage skip the step while
the last one steps, after which their scales differ and the early stage unscales by the wrong
factor, silently. The scaler is derived the same way so that its verdict is one MAX over every rank
(one scalar collective per optimizer step), as Megatron-LM and DeepSpeed combine theirs. The loss
itself is scaled by the last stage's loss function (see ``loss_multiplier``), because the backward
runs inside the schedule, before Lightning's ``pre_backward`` could scale it.
"""

from __future__ import annotations

import torch
import torch.distributed as dist
from lightning.pytorch.plugins.precision import Precision
from torch.distributed.tensor import DTensor
from torch.nn.utils import get_total_norm

from lightning_pp.errors import PipelineConfigError
from lightning_pp.layout.dtensors import full_value, local_tensor
from lightning_pp.split.derive import derive


def global_grad_norm(parameters: list[torch.nn.Parameter], group: dist.ProcessGroup | None) -> torch.Tensor:
    """The 2-norm of the gradients of every stage's parameters (a collective over ``group``).

    Sharded and tensor-parallel gradients (DTensors) contribute their whole tensor's norm, computed per mesh and
    placement (a collective over the replicas or shards that hold the pieces); plain ones their own. The sum of
    squares then crosses the pipeline ``group``, as torchtitan's ``clip_grad_norm_`` does.
    """
    grads = [p.grad for p in parameters if p.grad is not None]
    device = local_tensor(grads[0]).device if grads else torch.device("cpu")
    squared = torch.zeros(1, device=device)
    by_layout: dict[tuple, list[torch.Tensor]] = {}
    for grad in grads:
        key = (grad.device_mesh, tuple(grad.placements)) if isinstance(grad, DTensor) else ()
        by_layout.setdefault(key, []).append(grad)
    for key in sorted(by_layout, key=str):  # the same order on every rank of a mesh
        norm = full_value(get_total_norm(by_layout[key], 2.0))
        squared += norm.float().pow(2).reshape(1)
    if dist.is_initialized():
        dist.all_reduce(squared, group=group)
    return squared.sqrt()[0]


class _ClipByGlobalNorm:
    _pipeline_group: dist.ProcessGroup | None
    _counted_elsewhere: frozenset[int] = frozenset()

    def clip_grad_by_norm(self, optimizer: torch.optim.Optimizer, clip_val: float) -> None:
        parameters = list(self.main_params(optimizer))  # type: ignore[attr-defined]
        counted = [p for p in parameters if id(p) not in self._counted_elsewhere]
        total = global_grad_norm(counted, self._pipeline_group)
        # each rank scales its pieces by the one factor (torch's clip_grads_with_norm_ cannot mix DTensor and
        # plain gradients)
        factor = torch.clamp(clip_val / (total + 1e-6), max=1.0)
        for p in parameters:
            if p.grad is not None:
                local_tensor(p.grad).mul_(factor.to(p.grad.device))


class _OneVerdict:
    """A ``GradScaler`` whose inf/NaN verdict is the same on every rank.

    ``_unscale_grads_`` serves both ``unscale_`` and the fused optimizers' check, so every path
    (skip, clipping, scale update) reads the combined flag. A rank without gradients still votes.
    """

    def _unscale_grads_(
        self, optimizer: torch.optim.Optimizer, inv_scale: torch.Tensor, found_inf: torch.Tensor, allow_fp16: bool
    ) -> dict[torch.device, torch.Tensor]:
        per_device = super()._unscale_grads_(optimizer, inv_scale, found_inf, allow_fp16)  # type: ignore[misc]
        verdict = found_inf.clone()
        for flag in per_device.values():
            verdict = torch.maximum(verdict, flag.to(verdict.device))
        if dist.is_initialized():
            dist.all_reduce(verdict, op=dist.ReduceOp.MAX)
        return {verdict.device: verdict}


def pipeline_precision(plugin: Precision, group: dist.ProcessGroup | None, device: torch.device) -> Precision:
    """Make ``plugin`` clip by the norm over the pipeline ``group`` and, if it scales the loss, share one
    verdict over all ranks. The scale exists on every rank from the start (a rank whose stage never
    computes the loss still unscales)."""
    derive(plugin, _ClipByGlobalNorm)
    plugin._pipeline_group = group  # type: ignore[attr-defined]
    scaler = grad_scaler(plugin)
    if scaler is not None:
        derive(scaler, _OneVerdict)
        scaler.scale(torch.zeros((), device=device))
    return plugin


def count_once(plugin: Precision, counted_elsewhere: frozenset[int]) -> None:
    """Parameters several stages hold (see ``lightning_pp.split.tied``) enter the global norm on one rank only."""
    plugin._counted_elsewhere = counted_elsewhere  # type: ignore[attr-defined]


def grad_scaler(plugin: Precision) -> torch.amp.GradScaler | None:
    """The plugin's enabled loss scaler, if any (Lightning's ``MixedPrecision`` under ``16-mixed``)."""
    scaler = getattr(plugin, "scaler", None)
    if scaler is not None and not isinstance(scaler, torch.amp.GradScaler):
        # its scale could not be put into the last stage's loss: every step would unscale unscaled gradients
        raise PipelineConfigError(
            f"{type(plugin).__name__}.scaler is a {type(scaler).__qualname__}, which the pipeline cannot apply to the"
            " last stage's loss; pass a torch.amp.GradScaler (or a subclass) as the plugin's scaler."
        )
    return scaler if scaler is not None and scaler.is_enabled() else None


def loss_multiplier(plugin: Precision) -> float:
    """What the last stage multiplies each loss by before the schedule's backward: the current loss scale,
    so every stage's gradients carry it (and each stage's scaler unscales its own)."""
    scaler = grad_scaler(plugin)
    return 1.0 if scaler is None else scaler.get_scale()
