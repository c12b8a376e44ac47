"""One pipelined step: micro-batches in, torch's schedule in the middle, the user's own step at the end.

Data flows one way: batch -> micro-batches -> the inputs the user's step gives ``self(...)`` ->
torch schedule (P2P) -> last-stage output -> the user's step with ``self(...)`` returning that output
-> loss and logs (a ``StepReport``, on the last stage only).
"""

from __future__ import annotations

import contextlib
from collections import OrderedDict
from collections.abc import Callable, Iterable
from typing import Any

import torch
import torch.distributed as dist
from lightning.pytorch.utilities.rank_zero import rank_zero_info
from torch import nn
from torch._utils import _flatten_dense_tensors, _unflatten_dense_tensors
from torch.distributed.pipelining import PipelineStage
from torch.distributed.pipelining.schedules import PipelineScheduleSingle, _PipelineSchedule
from torch.nn.parallel import DistributedDataParallel
from torch.utils._pytree import tree_map_only

from lightning_pp.compat import release_differences
from lightning_pp.errors import PipelineConfigError
from lightning_pp.layout.options import Forecast
from lightning_pp.layout.schedule import SPLIT_BACKWARD, build_schedule, schedule_for
from lightning_pp.lifecycle.failure import failures_shared
from lightning_pp.memory.allocator import training_step_begins, trim_before_backward
from lightning_pp.runtime.forecast import ForecastCheck
from lightning_pp.runtime.inference_inputs import zeroed_inference_inputs
from lightning_pp.runtime.metrics import MetricTap
from lightning_pp.runtime.recompiles import RecompileWatch
from lightning_pp.runtime.relay import LogRecorder, StepReport, combine
from lightning_pp.runtime.split_backward import exact_split_backward
from lightning_pp.runtime.telemetry import Event, StepRecorder
from lightning_pp.split.experts import is_routed
from lightning_pp.split.microbatch import ModelCall, batch_size_of, capture_model_call, signature, split_batch
from lightning_pp.split.profiling import sum_of_outputs
from lightning_pp.split.pruned import StageModule, StageModules
from lightning_pp.split.stage import patched, running_stages
from lightning_pp.split.tied import SharedParameters

_MAX_CACHED_SHAPES = 4


def _reshard(module: nn.Module) -> None:
    """Evaluation leaves FSDP's parameters gathered (no backward reshards them). torch 2.15's end of the next
    training step then reshards only what that step gathered, so the step after it ran on the gathered copy
    from before the optimizer stepped (the loss of the second step after a validation off by 0.26); resharded
    here, every step gathers the current shards, and evaluation's gathered copy is not held into training."""
    from torch.distributed.fsdp import FSDPModule

    for unit in module.modules():
        if isinstance(unit, FSDPModule):
            unit.reshard()


def _initialized(schedule: _PipelineSchedule) -> bool:
    """False while torch runs shape inference (whose loss call must have no side effects)."""
    any_schedule: Any = schedule
    if isinstance(schedule, PipelineScheduleSingle):
        forward, backward = any_schedule._stage_forward_initialized, any_schedule._stage_backward_initialized
    else:
        forward, backward = any_schedule._stages_forward_initialized, any_schedule._stages_backward_initialized
    return bool(forward) and (not schedule._has_backward or bool(backward))


class PipelineRunner:
    """Runs the user's steps through torch's schedule on this rank's stages."""

    def __init__(
        self,
        module: nn.Module,
        stage_indices: list[int],
        make_stages: StageModules,
        n_stages: int,
        device: torch.device,
        group: dist.ProcessGroup | None,
        schedule: str,
        entries: dict[str, nn.Module],
        replicas: dist.ProcessGroup | None = None,
        label: int = 0,
        shared: SharedParameters | None = None,
        overlap_replicas: bool = True,
        sharded: str | None = None,
        forecast: Forecast | None = None,
    ) -> None:
        self.module = module  # the rank's module (all its stages): the user's step runs on it
        self.stage_indices = stage_indices
        self.n_stages = n_stages
        self.device = device
        self.group = group
        self.schedule_name = schedule
        self.is_last = n_stages - 1 in self.stage_indices
        self._make_stages = make_stages
        self._wrappers: list[StageModule] = []  # the current schedule's
        # replicas whose gradients this runner averages itself after each step (see SPLIT_BACKWARD); otherwise
        # torch's stages drive DDP: no sync while micro-batches accumulate, then the gradients are averaged over
        # the replicas during the last micro-batch's backward. DDP needs one wrapper per set of parameters:
        # ``overlap_replicas=False`` where stage modules change with the batch signature (traced pieces).
        # ``sharded`` ("step" or "microbatch", see lightning_pp.holding.sharding): the stage modules are FSDP roots,
        # which reduce the replicas' gradients themselves
        overlap = overlap_replicas and schedule not in SPLIT_BACKWARD
        self._average_over = replicas if not overlap and sharded is None else None
        self._replicas = replicas if sharded is None else None
        self._sharded = sharded
        self._ddp: dict[int, nn.Module] = {}
        self._recompiles = RecompileWatch(dist.get_rank() if dist.is_initialized() else 0)
        self._forecast = None if forecast is None else ForecastCheck(forecast, label, device)
        self._settle = forecast is None or forecast.limit_mib is None  # a memory_limit keeps the lean heap
        self._entries = entries
        self._shared = shared  # parameters other stages hold too (see lightning_pp.split.tied)
        self._schedules: OrderedDict[tuple, tuple[_PipelineSchedule, list[StageModule]]] = OrderedDict()
        self._current: _PipelineSchedule | None = None
        # per-step state used by the last stage's loss function
        self._step: Callable[..., Any] | None = None
        self._step_rest: tuple = ()
        self._step_kwargs: dict = {}
        self._microbatches: list[Any] = []
        self._losses: dict[int, torch.Tensor] = {}
        self.outputs: dict[int, Any] = {}  # what the user's step returned, per micro-batch (last stage)
        self.mb_rows = 0  # samples in each of them
        self._tap = MetricTap(module)
        self.recorder = StepRecorder(label)
        self.last_events: list[Event] = []
        self._recorder = LogRecorder()
        self._loss_scales: list[float] = []
        self._weights: list[float] | None = None

    def run(
        self,
        hook: str,
        args: tuple,
        kwargs: dict,
        n_microbatches: int,
        train: bool,
        loss_scale: float | list[float] = 1.0,
        record: bool = False,
        weights: list[float] | None = None,
    ) -> StepReport | None:
        """One step of ``hook`` (``training_step``, ``validation_step``, ...) over the whole batch.

        ``loss_scale`` multiplies each micro-batch loss before backward (1 / (m x accumulation), times the
        fp16 loss scale), or each its own (see ``lightning_pp.runtime.weighting``); ``weights`` combine the
        micro-batches' losses and logged means (default: their sizes). Returns the step's report on the last
        stage, None elsewhere.
        """
        m = n_microbatches
        self._loss_scales = list(loss_scale) if isinstance(loss_scale, list) else [loss_scale] * m
        self._weights = weights
        if train:
            training_step_begins(settle=self._settle)
            if self._forecast is not None:
                self._forecast.training_step_begins()
        with running_stages():
            report = self._run(hook, args, kwargs, n_microbatches, train, record)
        self._recompiles.step_done(train)
        return report

    def _run(
        self, hook: str, args: tuple, kwargs: dict, n_microbatches: int, train: bool, record: bool
    ) -> StepReport | None:
        step = getattr(self.module, hook)
        batch, rest = args[0], tuple(args[1:])
        microbatches = split_batch(batch, n_microbatches)
        inputs = [
            capture_model_call(self.module, self._entries, step, (mb, *rest), kwargs, hook) for mb in microbatches
        ]
        rows = batch_size_of(batch)
        self.mb_rows = rows // n_microbatches
        schedule, self._wrappers = self._schedule(train, n_microbatches, signature(batch), inputs[0])
        for wrapper in self._wrappers:
            wrapper.inputs, wrapper.mb_size = inputs, self.mb_rows
        self._step, self._step_rest, self._step_kwargs = step, rest, kwargs
        self._microbatches, self._losses = microbatches, {}
        self.outputs = {}
        self._recorder = LogRecorder(self._tap.paths)
        self._recorder.weight = float(self.mb_rows)

        self._current = schedule
        sample_index = torch.arange(rows)
        target = sample_index if self.is_last else None
        recording = self.recorder.recording() if record else contextlib.nullcontext([])
        try:
            with failures_shared(dist.get_rank(), dist.get_world_size()), self._tap.recording(), recording as events:
                if self._shared is not None:
                    self._shared.refresh()
                if train:
                    self._train(schedule, sample_index, target)
                    if self._shared is not None:
                        self._shared.sum_gradients()
                    if self._average_over is not None:
                        average_gradients(self.module.parameters(), self._average_over)
                else:
                    schedule.eval(mb=sample_index, target=target, return_outputs=False)
                    if self._sharded is not None:
                        _reshard(self.module)
            self.last_events = list(events)
        finally:
            for wrapper in self._wrappers:
                wrapper.outputs.clear()
            self._microbatches = []
            self._step = None
        if not self.is_last:
            return None
        loss = None
        if self._losses and len(self._losses) == n_microbatches:
            losses = torch.stack([self._losses[i] for i in range(n_microbatches)])
            loss = losses.mean() if self._weights is None else _weighted_mean(losses, self._weights)
        return StepReport(loss, combine(self._recorder.records), self._tap.states())

    def _schedule(
        self, train: bool, n_microbatches: int, shape_key: tuple, call: ModelCall
    ) -> tuple[_PipelineSchedule, list[StageModule]]:
        """Stages and a schedule per batch signature and mode: torch freezes shapes at first use."""
        key = (train, n_microbatches, shape_key)
        if key not in self._schedules:
            wrappers = self._make_stages(train, call)
            stages = [
                exact_split_backward(release_differences(zeroed_inference_inputs(
                    PipelineStage(self._replicated(w), index, self.n_stages, self.device, group=self.group)
                )))
                for w, index in zip(wrappers, self.stage_indices)
            ]  # fmt: skip
            schedule = self._build(stages, n_microbatches, train)
            order = schedule_for(self.schedule_name, n_microbatches, self.n_stages)
            if train and order != self.schedule_name:
                rank_zero_info(
                    f"A training batch of {n_microbatches} micro-batch(es) on {self.n_stages} stages runs in"
                    f" {order!r}'s order ({self.schedule_name!r} needs a micro-batch per stage): the same gradients,"
                    f" more waiting in that step; a batch of a multiple of {self.n_stages} samples fills the pipeline."
                )
            for chunk, stage in enumerate(stages):
                trim_before_backward(stage)
                self.recorder.instrument(stage, schedule, chunk)
            self._schedules[key] = (schedule, wrappers)
            while len(self._schedules) > _MAX_CACHED_SHAPES:
                self._schedules.popitem(last=False)
        else:  # stage modules every signature shares (a traced stage's FSDP root) take up this signature's piece
            self._make_stages(train, call)
        self._schedules.move_to_end(key)
        return self._schedules[key]

    def _build(self, stages: list[PipelineStage], n_microbatches: int, train: bool) -> _PipelineSchedule:
        return build_schedule(self.schedule_name, stages, n_microbatches, self._last_stage_loss, train)

    def _train(self, schedule: _PipelineSchedule, sample_index: torch.Tensor, target: torch.Tensor | None) -> None:
        """The batch's forwards and backwards: the micro-batches' sample indices travel as ``mb``."""
        schedule.step(mb=sample_index, target=target, return_outputs=False)

    def _replicated(self, wrapper: StageModule) -> nn.Module:
        """``wrapper`` under DDP when torch's stages average the replicas (one DDP per wrapper); an FSDP root
        hidden from torch's stage when each micro-batch reshards. A stage with nothing to train (frozen: a
        fine-tune's leading stages) has nothing to average, and DDP refuses it."""
        if self._sharded == "microbatch":
            return _Opaque(wrapper)
        trains = any(p.requires_grad for p in wrapper.parameters())
        if self._replicas is None or self._average_over is not None or not trains:
            return wrapper
        if id(wrapper) not in self._ddp:
            own = [name for name, p in wrapper.named_parameters() if is_routed(p)]  # each replica's own experts
            DistributedDataParallel._set_params_and_buffers_to_ignore_for_model(wrapper, own)
            self._ddp[id(wrapper)] = DistributedDataParallel(
                wrapper,
                process_group=self._replicas,
                device_ids=[self.device.index] if self.device.type == "cuda" else None,
                broadcast_buffers=False,
                find_unused_parameters=True,
            )
        return self._ddp[id(wrapper)]

    def _last_stage_loss(self, output: Any, target: torch.Tensor) -> torch.Tensor:
        assert self._current is not None
        if not _initialized(self._current):
            # torch's metadata pass over uninitialised data: the right graph, no side effects
            return sum_of_outputs(output)
        last = self._wrappers[-1]
        index = int(target[0]) // last.mb_size
        if self._weights is not None:  # the micro-batch's logged means count by its weight
            self._recorder.weight = self._weights[index]
        result = self._user_step(index, last.outputs.pop(index))
        # kept detached: a kept graph would keep the activations a split backward's input half retained until the
        # next step (ZBV: 42 MB of a 4-stage model's last stage here)
        self.outputs[index] = tree_map_only(torch.Tensor, torch.Tensor.detach, result)
        if not self._current._has_backward:  # what validation/test/predict return is not a loss (argmax ids)
            return torch.zeros((), device=self.device)
        loss = _loss_of(result)
        if loss is None:
            raise PipelineConfigError(
                f"training_step returned {type(result).__name__}; under the pipeline it must return the loss"
                " (a tensor, or a dict with a 'loss' key) on every micro-batch: skipping a step is not supported."
            )
        self._losses[index] = loss.detach()
        return loss * self._loss_scales[index]

    def _user_step(self, index: int, output: Any) -> Any:
        assert self._step is not None
        served: list[bool] = []

        def serve(*_: Any, **__: Any) -> Any:
            if served:
                raise PipelineConfigError(
                    f"{type(self.module).__name__}.{self._step.__name__} calls the model more than once; under the"  # type: ignore[union-attr]
                    " pipeline the step must call the model exactly once per batch."
                )
            served.append(True)
            return output

        with contextlib.ExitStack() as stack:
            stack.enter_context(patched(self.module, log=self._recorder))
            for entry in self._entries.values():
                stack.enter_context(patched(entry, forward=serve))
            return self._step(self._microbatches[index], *self._step_rest, **self._step_kwargs)


class _Opaque(nn.Module):
    """An FSDP root torch's stage does not recognise: FSDP then reshards and reduce-scatters after every
    micro-batch by its own hooks, as outside a pipeline (``fsdp_reshard="microbatch"``)."""

    def __init__(self, root: nn.Module) -> None:
        super().__init__()
        self.root = root

    def forward(self, *args: Any, **kwargs: Any) -> Any:
        return self.root(*args, **kwargs)


def average_gradients(parameters: Iterable[nn.Parameter], group: dist.ProcessGroup) -> None:
    """Average this step's gradients over the replicas, as DDP would: one flat all-reduce per dtype."""
    grads = [p.grad for p in parameters if p.grad is not None and not is_routed(p)]
    by_dtype: dict[torch.dtype, list[torch.Tensor]] = {}
    for grad in grads:
        by_dtype.setdefault(grad.dtype, []).append(grad)
    size = dist.get_world_size(group)
    for same in by_dtype.values():
        flat = _flatten_dense_tensors(same)
        dist.all_reduce(flat, group=group)
        flat.div_(size)
        for grad, averaged in zip(same, _unflatten_dense_tensors(flat, same)):
            grad.copy_(averaged)


def _weighted_mean(values: torch.Tensor, weights: list[float]) -> torch.Tensor:
    w = torch.tensor(weights, dtype=torch.float64, device=values.device)
    return ((values.double() * w).sum() / w.sum()).to(values.dtype) if w.sum() > 0 else values.mean()


def _loss_of(result: Any) -> torch.Tensor | None:
    if isinstance(result, torch.Tensor):
        return result
    if isinstance(result, dict) and isinstance(result.get("loss"), torch.Tensor):
        return result["loss"]
    return None
