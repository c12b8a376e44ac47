"""``split="prune"``: the module torch's ``PipelineStage`` runs for a stage, the user's ``forward`` on its view.

torch moves tensors only; the user's call (any pytree of inputs) stays on every rank, looked up by the
micro-batch's sample indices, and the previous stage's activations take the place of its leading inputs.
``split="trace"`` (``lightning_pp.split.traced``) builds on the same ``StageModule``.
"""

from __future__ import annotations

import functools
import inspect
from collections.abc import Callable
from typing import Any

import torch
from torch import nn
from torch.utils._pytree import tree_flatten, tree_map_only

from lightning_pp.errors import PipelineConfigError
from lightning_pp.memory.materialize import has_meta_tensors, on_meta
from lightning_pp.split.microbatch import ModelCall
from lightning_pp.split.stage import LayerNotHere, Placement, get_path, stage_view


class StageModule(nn.Module):
    """What torch's PipelineStage runs for one of this rank's stages.

    torch only moves tensors, so the user's inputs (any pytree) stay here, looked up by the
    micro-batch's sample indices that travel as the ``mb`` keyword; the last stage keeps the real
    output (any pytree) for the user's step and gives torch its tensors.
    """

    def __init__(self, is_last: bool) -> None:
        super().__init__()
        self.is_last = is_last
        self.inputs: list[ModelCall] = []
        self.outputs: dict[int, Any] = {}
        self.mb_size = 1

    def call_of(self, mb: torch.Tensor) -> tuple[int, ModelCall]:
        index = int(mb[0]) // self.mb_size
        return index, self.inputs[index]

    def keep_output(self, index: int, out: Any) -> tuple[torch.Tensor, ...] | torch.Tensor:
        """On the last stage: ``out`` for the user's step, its tensors for torch."""
        self.outputs[index] = out
        tensors = tuple(t for t in tree_flatten(out)[0] if isinstance(t, torch.Tensor))
        return tensors or torch.zeros(())

    @staticmethod
    def receive(received: tuple) -> tuple:
        """The previous stage's activations, their gradients made contiguous on the way back (gloo and NCCL send
        only contiguous tensors, and torch's stage sends a gradient with its own strides)."""
        return tuple(_ContiguousGrad.apply(t) if t.requires_grad else t for t in received)


StageModules = Callable[[bool, ModelCall], list[StageModule]]


def sendable(tensor: torch.Tensor) -> torch.Tensor:
    """What a stage hands the next: contiguous (gloo and NCCL send only contiguous tensors, and torch sends a
    tensor with its own strides) and not a view (the zero-bubble and V schedules' input pass detaches a stage's
    outputs in place, which a view refuses: Hugging Face OPT's layers return one)."""
    if not tensor.is_contiguous():
        return tensor.contiguous()
    return tensor.clone() if tensor._is_view() else tensor


def pruned_stages(views: dict[int, nn.Module], placement: Placement) -> StageModules:
    """``split="prune"``: each stage runs the user's ``forward`` on its view, for every batch signature."""
    last = placement.n_stages - 1
    modules: list[StageModule] = [_PrunedStage(v, s == last, placement.absent_on(s)) for s, v in views.items()]
    return lambda train, call: modules


_RUN_FOR_REAL_BYTES = 2**30  # an eager module up to this size is run for real first: its values are compared too
DIFFERS = "forward's result run stage by stage differs from its result whole"
FAILS = "forward fails run stage by stage though it runs whole"


def unprunable(module: nn.Module, placement: Placement, call: ModelCall) -> str | None:
    """Why the user's forward cannot run the module pruned to its stages: it calls a part that another stage holds
    (None on this one) instead of skipping it, indexes the layers by position, fails otherwise on a stage (reads
    an output another stage computes, as Hugging Face's classifiers read the pooler's), hands the next stage
    something other than tensors, or computes another result stage by stage than whole (``enumerate(self.layers)`` or
    ``len(self.layers)`` in forward count a stage's layers only: silently other training). Found at set-up by
    running the stages' views one after another on what each hands the next, as at run time, and comparing with
    the whole forward: for real on the CPU for an eager module (in eval mode, the RNG left as it was; first up to
    1 GiB, else only where meta cannot run its forward, as Hugging Face's masks), else on meta tensors (shapes
    only). None when the stages compose to the forward, or when nothing can tell."""
    eager = not has_meta_tensors(module)
    small = eager and sum(t.nbytes for t in (*module.parameters(), *module.buffers())) <= _RUN_FOR_REAL_BYTES
    attempts = [_for_real, _on_meta] if small else [_on_meta, _for_real] if eager else [_on_meta]
    for attempt in attempts:
        try:
            return attempt(module, placement, call)
        except Exception:  # noqa: BLE001 (this way cannot tell: the next, or the run shows it)
            continue
    return None


def _on_meta(module: nn.Module, placement: Placement, call: ModelCall) -> str | None:
    with on_meta(module) as to_meta:
        return _first_failure(module, placement, call, to_meta, values=False)


def _for_real(module: nn.Module, placement: Placement, call: ModelCall) -> str | None:
    modes = {m: m.training for m in module.modules()}
    try:
        with torch.random.fork_rng(devices=[]):
            module.eval()
            cpu = functools.partial(tree_map_only, torch.Tensor, torch.Tensor.cpu)
            return _first_failure(module, placement, call, cpu, values=True)
    finally:
        for m, training in modes.items():
            m.training = training


def _first_failure(
    module: nn.Module, placement: Placement, call: ModelCall, convert: Callable[[Any], Any], values: bool
) -> str | None:
    args, kwargs = convert((call.args, call.kwargs))
    last = placement.n_stages - 1
    with torch.no_grad():
        model = get_path(module, call.entry)
        whole = type(model).forward(model, *args, **kwargs)
        received: tuple = ()
        for stage in range(placement.n_stages):
            model = get_path(stage_view(module, placement, [stage]), call.entry)
            try:
                out = _stage_forward(model, args, kwargs, received)
            except _CalledNone as error:
                return (
                    "forward calls the parts other stages hold instead of skipping them (on stage"
                    f" {stage}, where {placement.absent_on(stage)} are None: {error.__cause__})"
                )
            except LayerNotHere as error:
                return f"forward indexes the layers by position (on stage {stage}: {error})"
            except Exception as error:  # noqa: BLE001 (the whole forward ran: its stages do not)
                return (
                    f"{FAILS} (on stage {stage}, where {placement.absent_on(stage)} are None:"
                    f" {type(error).__name__}: {error})"
                )
            received = out if isinstance(out, tuple) else (out,)
            if stage < last and not all(isinstance(t, torch.Tensor) for t in received):
                return f"forward returns {type(out).__name__} on stage {stage}, where a pruned stage hands on tensors"
    difference = _difference(whole, out, values)
    if difference is not None:
        return (
            f"{DIFFERS} ({difference}; a forward that depends on the layers' positions or count, such as"
            " enumerate(self.layers) or len(self.layers), does)"
        )
    return None


def _difference(whole: Any, staged: Any, values: bool) -> str | None:
    ours = [t for t in tree_flatten(whole)[0] if isinstance(t, torch.Tensor)]
    theirs = [t for t in tree_flatten(staged)[0] if isinstance(t, torch.Tensor)]
    if [t.shape for t in ours] != [t.shape for t in theirs]:
        return f"shapes {[tuple(t.shape) for t in ours]} whole, {[tuple(t.shape) for t in theirs]} by stages"
    for a, b in zip(ours, theirs):
        if values and a.is_floating_point() and a.numel():
            gap = (a.double() - b.double()).abs().max().item()
            if not gap <= 1e-4 * max(1.0, a.double().abs().max().item()):
                return f"by up to {gap:.3g}"
    return None


class _ContiguousGrad(torch.autograd.Function):
    """The identity, with its gradient made contiguous. torch's stage sends a stage's input gradient back in a
    buffer with the gradient's own strides, and gloo and NCCL take only contiguous tensors: a stage whose first
    op transposes its input failed with "input tensor has to be contiguous"."""

    @staticmethod
    def forward(ctx: Any, tensor: torch.Tensor) -> torch.Tensor:
        return tensor.view_as(tensor)

    @staticmethod
    def backward(ctx: Any, grad: torch.Tensor) -> torch.Tensor:
        return grad.contiguous()


class _PrunedStage(StageModule):
    """The user's ``forward`` on this rank's pruned module (a view holding one stage)."""

    def __init__(self, module: nn.Module, is_last: bool, absent: list[str]) -> None:
        super().__init__(is_last)
        self.module = module
        self.absent = absent

    def forward(self, *received: torch.Tensor, mb: torch.Tensor) -> Any:
        index, (entry, args, kwargs) = self.call_of(mb)
        model = get_path(self.module, entry)
        received = self.receive(received)
        try:
            out = _stage_forward(model, args, kwargs, received)
        except _CalledNone as called:
            error = called.__cause__
            raise PipelineConfigError(
                f"forward failed on this pipeline stage ({error}). Here {self.absent} are None because other stages"
                " hold them; forward must skip parts that are None, e.g."
                " `h = self.embed(x) if self.embed is not None else x`, or pass PipelineStrategy(split='trace') to"
                " have torch's tracer split the model as it is (Hugging Face and nanoGPT-style models)."
            ) from error
        if self.is_last:
            return self.keep_output(index, out)
        if isinstance(out, torch.Tensor):
            return sendable(out)
        if isinstance(out, tuple) and out and all(isinstance(t, torch.Tensor) for t in out):
            return tuple(map(sendable, out))
        raise PipelineConfigError(
            f"forward returned {type(out).__name__} on a stage that is not the last; a stage must hand the next"
            " one a tensor (or a tuple of tensors): return the hidden state when the later parts are None."
        )


class _CalledNone(Exception):
    """The user's forward called a part that is None on this stage (the error it raised is the cause)."""


def _stage_forward(model: nn.Module, args: tuple, kwargs: dict, received: tuple) -> Any:
    """The user's forward on a stage's view, the previous stage's activations (if any) in place of its leading
    inputs."""
    if received:
        args, kwargs = replace_leading_inputs(type(model).forward, model, args, kwargs, received)
    try:
        return type(model).forward(model, *args, **kwargs)
    except (TypeError, AttributeError) as error:
        if "NoneType" not in str(error):
            raise
        raise _CalledNone() from error


def replace_leading_inputs(
    forward: Callable[..., Any], model: nn.Module, args: tuple, kwargs: dict, received: tuple
) -> tuple[tuple, dict]:
    """The user's call with the previous stage's activations in place of its leading inputs.

    Leading in the order of ``forward``'s parameters, so ``self(x, mask)`` and
    ``self.model(input_ids=x, mask=m)`` both get the hidden state where ``x`` was.
    """
    try:
        bound = inspect.signature(forward).bind(model, *args, **kwargs)
    except TypeError:
        return tuple(received) + tuple(args[len(received) :]), kwargs
    names = list(bound.signature.parameters)[1:]
    kinds = [bound.signature.parameters[n].kind for n in names[: len(received)]]
    if any(k in (inspect.Parameter.VAR_POSITIONAL, inspect.Parameter.VAR_KEYWORD) for k in kinds):
        return tuple(received) + tuple(args[len(received) :]), kwargs
    for name, value in zip(names, received):
        bound.arguments[name] = value
    return tuple(bound.args[1:]), dict(bound.kwargs)
