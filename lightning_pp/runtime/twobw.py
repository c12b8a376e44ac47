"""PipeDream-2BW (Narayanan et al., ICML 2021): the asynchronous pipeline with two weight versions, no flush.

Each stage runs one endless 1F1B stream: while batch k's backwards finish, the forwards of batch k+1's
first micro-batches (its "heads", p-1-r of them on stage r) already run, so the bubble of a flushing
1F1B disappears after the first batch. Exact semantics (issue 22): optimizer window n (its batches,
every micro-batch, forward and backward) is computed on W(n-1), the weights before the previous step
(W(-1) = W(0)); the step after window n computes W(n+1) from W(n) with window n's gradients: a delay of
exactly one step on every stage.

A version is bound to the stage module for its forwards with
``torch.nn.utils.stateless._reparametrize_module`` (a backward needs none: autograd's graph holds the
tensors its forward ran on); gradients land on the version's tensors and move to the live parameters
after each batch. Before each optimizer step the live parameters move to a copy, so the step writes
W(n+1) beside W(n), which window n+1 (and the heads already in flight) keep using.
"""

from __future__ import annotations

import contextlib
from collections.abc import Iterator
from typing import Any

import torch
import torch.distributed as dist
from lightning.pytorch.utilities.rank_zero import rank_zero_info
from torch import nn
from torch.distributed.pipelining import schedules as torch_schedules
from torch.distributed.pipelining.schedules import PipelineScheduleSingle
from torch.nn.utils.stateless import _reparametrize_module

from lightning_pp.compat import initialize_stage
from lightning_pp.errors import PipelineConfigError
from lightning_pp.layout.schedule import ASYNC, build_schedule
from lightning_pp.runtime.step import PipelineRunner
from lightning_pp.split.microbatch import capture_model_call, signature, split_batch

OLDER = "pipedream_2bw_older_weights"  # the key in a parameter's optimizer state


class WeightVersions:
    """The weights each optimizer window runs on, for one stage module.

    ``of(n)`` is window n's version: W(n-1), tensors that alias the live parameters' storage as it was
    after n-1 steps. The live Parameters (what the optimizer updates and checkpoints hold) are W(steps).
    """

    def __init__(self, module: nn.Module, older: dict[int, torch.Tensor]) -> None:
        self._live = dict(module.named_parameters())
        self._versions: dict[int, dict[str, torch.Tensor]] = {}
        self.steps = 0  # optimizer steps taken in this fit
        if older:  # resumed: the first window runs on the version before the checkpoint's step
            self._versions[0] = {
                name: older[id(p)].detach().requires_grad_(p.requires_grad) for name, p in self._live.items()
            }

    def next_window_weights(self) -> dict[int, torch.Tensor]:
        """By parameter identity: what the coming window runs on (saved beside the live weights)."""
        version = self.of(self.steps)
        return {id(p): version[name].detach() for name, p in self._live.items()}

    def of(self, window: int) -> dict[str, torch.Tensor]:
        if window not in self._versions:
            # first needed while the live parameters still are W(window - 1): by the heads of window's first batch
            # during the window before, by window 0 at the start, or at the step that ends the window before
            assert self.steps == max(window - 1, 0), (window, self.steps)
            self._versions[window] = {
                name: p.data.requires_grad_(p.requires_grad) for name, p in self._live.items()
            }  # ``.data``: the same storage under its own version counter, a leaf the micro-batches' graphs keep
        return self._versions[window]

    @contextlib.contextmanager
    def bound(self, module: nn.Module, window: int) -> Iterator[None]:
        with _reparametrize_module(module, self.of(window), tie_weights=True):
            yield

    def collect(self, window: int) -> None:
        """Window ``window``'s gradients of the batch that just finished, onto the live parameters."""
        for name, tensor in self.of(window).items():
            self._live[name].grad, tensor.grad = tensor.grad, None

    def before_step(self) -> None:
        """At the end of window n = ``steps``: its version is done; window n+1 keeps W(n), and the live
        Parameters move to a copy that the optimizer then updates in place to W(n+1)."""
        window = self.steps
        self.of(window + 1)
        self._versions.pop(window, None)
        for p in self._live.values():
            p.data = p.data.clone()
        self.steps += 1


class Schedule2BW(PipelineScheduleSingle):
    """One stage's 2BW stream over torch's ``PipelineStage``, one Lightning step (batch) per ``iterate`` call.

    The stream pairs F(j + w) with B(j), w = p - 1 - r: a batch's backwards all run in its step, together with
    its remaining forwards and the next batch's first w forwards. Forwards of batch k+1 reuse micro-batch ids
    0..w-1, free since batch k's backwards of those ids ran earlier in the step. The first forward of the next
    step receives its input from the previous stage in this step (that stage sent it among its heads): the
    receive is posted and waited before the step returns, so no other traffic (validation) runs in between.
    """

    def __init__(self, stage: Any, n_microbatches: int, loss_fn: Any, versions: WeightVersions) -> None:
        super().__init__(stage, n_microbatches, loss_fn=loss_fn, scale_grads=False)
        self.versions = versions
        self._w = stage.num_stages - 1 - stage.stage_index
        self._heads = 0  # forwards of the coming batch already run (its first micro-batches)
        self._received = False  # the coming batch's first non-head forward input is here
        self._held: Any = None  # last stage: the coming batch's first output, its loss not computed yet
        self._binding = contextlib.ExitStack()
        self._bound: int | None = None  # the window whose weights the stage module runs on now

    @property
    def heads(self) -> int:
        """How many of the next batch's micro-batches a step forwards here (the last stage: its first, held)."""
        return min(self._n_microbatches, self._w or 1)

    def _step_microbatches(self, *args: Any, **kwargs: Any) -> None:
        raise RuntimeError("Schedule2BW runs through iterate(), one batch at a time")

    def iterate(
        self,
        kwarg_mbs: list[dict[str, Any]],
        target_mbs: list[Any] | None,
        window: int,
        next_kwarg_mbs: list[dict[str, Any]] | None,
        next_window: int,
    ) -> None:
        """Batch k (``kwarg_mbs``, window ``window``): all its backwards; the next batch's heads if one follows."""
        stage, m, w = self._stage, self._n_microbatches, self._w
        stage.has_backward = True
        initialize_stage(self, (), kwarg_mbs[0], target_mbs[0] if target_mbs is not None else None)
        stage.output_chunks.clear()
        self._internal_losses.clear()
        if self._held is not None:  # the user's step on it belongs to this batch's step
            output, stage.submod.outputs[0] = self._held
            self._maybe_compute_loss(stage, output, target_mbs, 0)
            self._held = None
        stream = [(window, j, kwarg_mbs[j]) for j in range(m)]
        if next_kwarg_mbs is not None:
            stream += [(next_window, j, next_kwarg_mbs[j]) for j in range(min(w, m))]
        done, sends = self._heads, []
        try:
            for j in range(m):
                while done < len(stream) and done <= j + w:
                    sends += self._forward(stream[done], target_mbs, received=done == self._heads and self._received)
                    done += 1
                sends += self._backward(j)
        finally:
            self._bind(None)
        self.versions.collect(window)
        self._heads = done - m
        self._received = False
        if next_kwarg_mbs is not None and not stage.is_first and self._heads < m:
            _wait(_post(stage.get_fwd_recv_ops(self._heads), desc="fwd_recv"))
            self._received = True
            if stage.is_last:  # it would idle until the first stage's last backward: forward the next batch's first
                self._hold(next_kwarg_mbs[0], next_window, m)
        _wait(sends)

    def _hold(self, kwargs: dict[str, Any], window: int, m: int) -> None:
        """The last stage's forward of the next batch's first micro-batch, at the end of this step: its output
        waits, as the user's step would see it, for the loss at the next step."""
        stage = self._stage
        self._bind(window)
        try:
            output = stage.forward_one_chunk(0, (), kwargs, save_forward_output=False)
        finally:
            self._bind(None)
        self._held = (output, stage.submod.outputs.pop(m))  # kept under the next batch's index (m + 0)
        self._heads, self._received = 1, False

    def _forward(self, item: tuple, target_mbs: list[Any] | None, received: bool) -> list[dist.Work]:
        window, mb, kwargs = item
        stage = self._stage
        if not received:
            _wait(_post(stage.get_fwd_recv_ops(mb), desc="fwd_recv"))
        self._bind(window)
        output = stage.forward_one_chunk(mb, (), kwargs, save_forward_output=False)
        if stage.is_last:
            self._maybe_compute_loss(stage, output, target_mbs, mb)
        return _post(stage.get_fwd_send_ops(mb), desc="fwd_send")

    def _backward(self, mb: int) -> list[dist.Work]:
        """Autograd's graph holds the version the forward ran on: no binding (no recomputation under 2BW)."""
        stage = self._stage
        _wait(_post(stage.get_bwd_recv_ops(mb), desc="bwd_recv"))
        stage.backward_one_chunk(mb, loss=self._maybe_get_loss(stage, mb), last_backward=False)
        return _post(stage.get_bwd_send_ops(mb), desc="bwd_send")

    def _bind(self, window: int | None) -> None:
        """Rebinding costs a swap per parameter: only where the window changes (at the next batch's heads)."""
        if window == self._bound:
            return
        self._binding.close()
        if window is not None:
            self._binding.enter_context(self.versions.bound(self._stage.submod, window))
        self._bound = window


def _post(ops: list[dist.P2POp], desc: str) -> list[dist.Work]:
    return torch_schedules._batch_p2p(ops, desc=desc)  # looked up at each call: the telemetry times torch's


def _wait(works: list[dist.Work]) -> None:
    torch_schedules._wait_batch_p2p(works)


class TwoBWRunner(PipelineRunner):
    """The runner for ``schedule="2bw"``: training steps stream through ``Schedule2BW``; evaluation runs torch's
    1F1B on the live weights (the stream's P2P is quiet between steps)."""

    def __init__(self, *args: Any, **kwargs: Any) -> None:
        super().__init__(*args, **{**kwargs, "overlap_replicas": False})  # replicas averaged after each batch
        self._next: tuple | None = None
        self._window = (0, 0)
        self._versions: WeightVersions | None = None
        self._older: dict[int, torch.Tensor] = {}  # read from a checkpoint, for the first window
        self._params: dict[int, nn.Parameter] = {}  # the optimizer's, by identity
        self._stashed = False  # the optimizer state holds the older weights a save put there

    def look_ahead(self, next_args: tuple | None, window: int, next_window: int) -> None:
        """What the coming training step streams into: the next batch's step arguments (None: drain), and the
        optimizer windows of this batch and the next."""
        self._next, self._window = next_args, (window, next_window)

    def stash_older(self, optimizer: torch.optim.Optimizer) -> None:
        """Before the optimizer state is saved: the coming window's weights join each parameter's state, so every
        checkpoint format and layout carries them by parameter name (popped again at the next step)."""
        if self._versions is None:
            return
        for param_id, tensor in self._versions.next_window_weights().items():
            optimizer.state[self._params[param_id]][OLDER] = tensor
        self._stashed = True

    def adopt_older(self, optimizer: torch.optim.Optimizer, resumed: bool) -> None:
        """Before a step: take stashed weights out of the optimizer state (after a save; AdamW would take a state
        holding only them for an initialised one); at the first, after a resume, they are the first window's
        weights (a checkpoint written by another schedule has none: the live weights)."""
        if self._versions is not None and not self._stashed:
            return
        found = {id(p): state.pop(OLDER) for p, state in optimizer.state.items() if OLDER in state}
        self._stashed = False
        if self._versions is not None:
            return
        self._params = {id(p): p for group in optimizer.param_groups for p in group["params"]}
        self._older = found
        if resumed and not found:
            rank_zero_info(
                "schedule='2bw': the checkpoint holds no older weight version (written by another schedule); the"
                " first window runs on the live weights, as at the start of training."
            )

    def end_window(self) -> None:
        if self._versions is not None:
            self._versions.before_step()

    @property
    def optimizer_steps(self) -> int:
        return 0 if self._versions is None else self._versions.steps

    def _build(self, stages: list[Any], n_microbatches: int, train: bool) -> Any:
        if not train:  # evaluation: a flushing 1F1B on the live weights
            return build_schedule("1f1b", stages, n_microbatches, self._last_stage_loss, train)
        (stage,) = stages
        if self._versions is None:  # every batch signature's stage holds the same parameters: one set of versions
            self._versions = WeightVersions(stage.submod, self._older)
            self._older = {}
        return Schedule2BW(stage, n_microbatches, self._last_stage_loss, self._versions)

    def _train(self, schedule: Any, sample_index: torch.Tensor, target: torch.Tensor | None) -> None:
        rows, m = len(sample_index), schedule._n_microbatches
        chunks = [{"mb": part} for part in sample_index.chunk(m)]
        following = None
        if self._next is not None:  # the next batch's calls follow this batch's in the stages' input lists
            step = self._step
            batch, rest = self._next[0], tuple(self._next[1:])
            calls = [
                capture_model_call(self.module, self._entries, step, (mb, *rest), self._step_kwargs, "training_step")
                for mb in split_batch(batch, m)[: schedule.heads]
            ]
            for wrapper in self._wrappers:
                wrapper.inputs = list(wrapper.inputs) + calls
            following = [{"mb": chunk["mb"] + rows} for chunk in chunks]
        targets = [chunk["mb"] for chunk in chunks] if self.is_last else None
        window, next_window = self._window
        schedule.iterate(chunks, targets, window, following, next_window)


class LookAhead:
    """The train loader one item ahead: a 2BW step forwards the first micro-batches of the next batch.

    Lightning's fetcher does not read ahead of a sized loader, and a step cannot lag one batch behind (Lightning
    refuses a ``training_step`` that returns None under distributed training), so the strategy peeks here.
    """

    def __init__(self, loader: Any) -> None:
        self.loader = loader
        self.following: Any = _END
        self._served: Any = None  # a stateful loader's state after the items served so far, not the one peeked

    def __len__(self) -> int:
        return len(self.loader)

    def __getattr__(self, name: str) -> Any:
        if name == "loader":
            raise AttributeError(name)
        if name == "state_dict" and hasattr(self.loader, "state_dict"):  # Lightning saves it for mid-epoch resumes
            return lambda: self._served if self._served is not None else self.loader.state_dict()
        return getattr(self.loader, name)

    def __iter__(self) -> Iterator[Any]:
        items = iter(self.loader)
        self.following = next(items, _END)
        stateful = hasattr(self.loader, "state_dict")
        while self.following is not _END:
            self._served = self.loader.state_dict() if stateful else None
            item, self.following = self.following, next(items, _END)
            yield item


_END = object()


def check_optimizers(schedule: str, optimizers: list[Any]) -> None:
    if schedule in ASYNC and len(optimizers) != 1:
        raise PipelineConfigError(
            f"schedule='2bw' keeps one weight version per optimizer step, but configure_optimizers returned"
            f" {len(optimizers)} optimizers; return one (with parameter groups for different settings)."
        )


def look_ahead(loader: Any, schedule: str, training: bool) -> Any:
    """2BW's train loader, one item ahead; refused without a length (Lightning's fetcher reads an unsized loader
    one item ahead itself, so the item seen here would not be the next batch)."""
    if schedule not in ASYNC or not training:
        return loader
    try:
        len(loader)  # type: ignore[arg-type]
    except TypeError:
        raise PipelineConfigError(
            f"schedule='2bw' needs a train loader with a length, got {type(loader).__name__} without one (an"
            " IterableDataset?): use a map-style dataset, or give the IterableDataset a __len__."
        ) from None
    return LookAhead(loader)


def prepare_step(runner: PipelineRunner, trainer: Any, strategy: Any, args: tuple) -> None:
    """Before a 2BW training step: the next batch of the epoch (transferred as Lightning transfers a batch), if the
    stream goes on past this one, and the optimizer windows of both."""
    if not isinstance(runner, TwoBWRunner):
        return
    runner.adopt_older(strategy.optimizers[0], trainer.ckpt_path is not None)
    batch_idx = int(args[1])
    window_end = not trainer.fit_loop._should_accumulate()
    steps = runner.optimizer_steps
    following = next((loader.following for loader in _loaders(trainer) if isinstance(loader, LookAhead)), _END)
    last_step = trainer.max_steps >= 0 and trainer.global_step + int(window_end) >= trainer.max_steps
    if following is _END or batch_idx + 1 >= trainer.num_training_batches or last_step:
        runner.look_ahead(None, steps, steps)
        return
    batch = trainer.precision_plugin.convert_input(following)
    batch = trainer.lightning_module._on_before_batch_transfer(batch, dataloader_idx=0)
    batch = strategy.batch_to_device(batch, dataloader_idx=0)
    if signature(batch) != signature(
        args[0]
    ):  # a partial last batch: its stages have other shapes, a stream of its own
        runner.look_ahead(None, steps, steps)
        return
    runner.look_ahead((batch, batch_idx + 1, *args[2:]), steps, steps + int(window_end))


def _loaders(trainer: Any) -> list[Any]:
    combined = trainer.fit_loop._combined_loader
    return [] if combined is None else list(combined.flattened)


def runner_for(schedule: str) -> type[PipelineRunner]:
    return TwoBWRunner if schedule in ASYNC else PipelineRunner


def end_window(runner: PipelineRunner | None) -> None:
    """At an optimizer window's end, before the optimizer steps (2BW: the versions rotate)."""
    if isinstance(runner, TwoBWRunner):
        runner.end_window()


def stash_older(runner: PipelineRunner | None, optimizer: torch.optim.Optimizer) -> None:
    if isinstance(runner, TwoBWRunner):
        runner.stash_older(optimizer)
