"""What differs between the torch releases lightning-pp supports (2.11 to 2.15), one named shim each.

Everything else the package uses of ``torch.distributed.pipelining``, FSDP2 and DCP reads the same in
all five (their private names included); a difference found goes here with the release it covers and the
test that catches it.
"""

from __future__ import annotations

import re
from typing import Any

import torch

OLDEST = (2, 11)
RELEASE = tuple(int(n) for n in re.match(r"(\d+)\.(\d+)", torch.__version__).groups())


def _refuse_an_older_torch(version: str) -> None:
    """Below 2.11 the pipelining runtime lacks what this package builds on (2.11's is the oldest whose schedules,
    stages and split backward it is tested with): refused at import, not deep in the first step."""
    found = tuple(int(n) for n in re.match(r"(\d+)\.(\d+)", version).groups())
    if found < OLDEST:
        raise ImportError(
            f"lightning-pp needs torch >= {OLDEST[0]}.{OLDEST[1]} (it supports 2.11 to 2.15); this environment has"
            f" torch {version}. Install a supported release, e.g. pip install 'torch>=2.11,<2.16' (with the CUDA"
            " build your machine needs)."
        )


_refuse_an_older_torch(torch.__version__)

try:  # torch >= 2.15: the runtime retires each send at an explicit WAIT_SEND_F/WAIT_SEND_B of the order
    from torch.distributed.pipelining.schedules import _add_wait_send
except ImportError:  # torch 2.11 to 2.14: the runtime waits for sends by itself
    _add_wait_send = None


def with_send_waits(order_with_comms: dict[int, list[Any]]) -> dict[int, list[Any]]:
    """A lowered order (sends and receives added) as this torch's runtime runs it: torch 2.15 raises "Pipeline
    sends have no matching wait" at the end of a step whose order has no wait for a send."""
    return order_with_comms if _add_wait_send is None else _add_wait_send(order_with_comms)


def inference_inputs_left_uninitialised() -> bool:
    """Whether torch makes a later stage's shape-inference inputs with ``torch.empty`` (``PipelineStage._to_tensor``,
    torch >= 2.12): those need zeroing. torch 2.11's ``_shape_inference`` makes them with ``zeros_like`` itself."""
    return RELEASE >= (2, 12)


def buffers_kept_through_metadata_inference(stage: Any) -> Any:
    """``stage`` (a ``PipelineStage``) whose first-step metadata inference leaves the module's buffers as they were.

    The inference runs real forwards; torch 2.14 backs the buffers up and restores them afterwards, torch 2.11 to
    2.13 left their updates in (BatchNorm's running statistics moved once more for every new batch signature)."""
    if RELEASE >= (2, 14):  # it does it itself
        return stage
    saved: list[tuple[Any, Any]] = []

    def keep() -> None:
        saved[:] = [(b, b.detach().clone()) for b in stage.submod.buffers()]

    def restore() -> None:
        for buffer, copy in saved:
            buffer.detach().copy_(copy)
        saved.clear()

    if RELEASE < (2, 12):  # one forward, in _shape_inference
        infer = stage._shape_inference

        def infer_keeping(*args: Any, **kwargs: Any) -> Any:
            keep()
            try:
                return infer(*args, **kwargs)
            finally:
                restore()

        stage._shape_inference = infer_keeping
        return stage
    prepare, cleanup = stage._prepare_forward_infra, stage._post_metadata_inference_cleanup

    def prepare_keeping(*args: Any, **kwargs: Any) -> Any:
        keep()
        return prepare(*args, **kwargs)

    def cleanup_restoring() -> None:
        cleanup()
        restore()

    stage._prepare_forward_infra, stage._post_metadata_inference_cleanup = prepare_keeping, cleanup_restoring
    return stage


def warm_up_without_self_sends(stage: Any) -> Any:
    """``stage`` whose first-step warm-up of its neighbours' links skips neighbours on its own rank.

    torch 2.11 warms up every neighbouring stage by a send and a receive, its own rank's included (V schedules'
    middle stages, every stage of a loop schedule on one rank), which gloo refuses ("Pair is not connected"); the
    runtime hands those stages' tensors over directly, so the links are never used. torch >= 2.12 warms up by a vote
    that leaves them out."""
    if RELEASE >= (2, 12):
        return stage
    ops = stage._get_init_p2p_neighbors_ops

    def ops_to_others() -> list[Any]:
        return [op for op in ops() if op.group_peer != stage.group_rank]

    stage._get_init_p2p_neighbors_ops = ops_to_others
    return stage


def initialize_stage(schedule: Any, args: tuple, kwargs: dict[str, Any], target: Any) -> None:
    """A single-stage schedule's first-step set-up, run by a schedule of our own (2BW) that steps without ``step()``:
    torch >= 2.12 infers the backward's metadata from the first micro-batch's target too, torch 2.11 from its
    inputs alone (``_initialize_stage(args, kwargs)``)."""
    if RELEASE >= (2, 12):
        schedule._initialize_stage(args, kwargs, target)
    else:
        schedule._initialize_stage(args, kwargs)


def _floating(tensor: Any) -> bool:
    return isinstance(tensor, torch.Tensor) and (tensor.is_floating_point() or tensor.is_complex())


def no_gradient_for_tensors_that_need_none(stage: Any) -> Any:
    """``stage`` whose backward leaves out the tensors it received and hands on that need no gradient (a traced
    model's position ids and masks; its rotary tables, made under ``no_grad``): it sends no gradient back for them
    and differentiates no such output.

    torch 2.11 and 2.12 expect a gradient for every received tensor and refuse the step without one ("has gradients
    None and is expecting to send gradients to stage 0"), while the stage before waits for none (2.12: where its
    output needs no gradient; 2.11, here: where it is not floating); their split backward's input pass
    differentiates every output ("element 1 of tensors does not require grad"), and 2.11's returns the gradients
    of the inputs that need them in a row, where the sends expect one per input. torch >= 2.13 does as this does."""
    from torch.distributed.pipelining import stage as torch_stage

    if RELEASE >= (2, 13):
        return stage
    send_info, backward = stage._create_grad_send_info, stage.backward_maybe_with_nosync
    in_a_row = RELEASE < (2, 12)

    def needs_gradient(info: Any) -> bool:
        meta = getattr(info, "tensor_meta", None)  # 2.12: what the stage before made; 2.11 has none
        return meta.requires_grad if meta is not None else _floating(info.buffer)

    def send_info_needed(args_recv_info: tuple) -> list[Any]:
        destinations = send_info(args_recv_info)
        return [
            dst if not isinstance(info, torch_stage._RecvInfo) or needs_gradient(info) else None
            for info, dst in zip(args_recv_info, destinations)
        ]

    def backward_of_needed(backward_type: str, bwd_kwargs: dict, last_backward: bool = False) -> Any:
        if backward_type == "input" and bwd_kwargs["output_grads"] is not None:
            outputs, output_grads = bwd_kwargs["stage_output"], bwd_kwargs["output_grads"]
            kept = [(o, g) for o, g in zip(outputs, output_grads) if o.requires_grad or o.grad_fn is not None]
            bwd_kwargs["stage_output"], bwd_kwargs["output_grads"] = tuple(o for o, _ in kept), [g for _, g in kept]
        grads, rest = backward(backward_type, bwd_kwargs, last_backward)
        if backward_type == "input" and in_a_row:
            needing, inputs = iter(grads), bwd_kwargs["input_values"]
            grads = tuple(next(needing) if isinstance(t, torch.Tensor) and t.requires_grad else None for t in inputs)
        return grads, rest

    stage._create_grad_send_info, stage.backward_maybe_with_nosync = send_info_needed, backward_of_needed
    return stage


def non_floating_tensors_received(stage: Any) -> Any:
    """``stage`` able to receive integer and boolean tensors from the stage before it, and to hand them on.

    torch 2.11 makes every tensor a stage receives require gradients ("only Tensors of floating point dtype can
    require gradients") and has the stage before wait for a gradient of each, by receive or, on the same rank, by
    hand-over; torch >= 2.12 marks floating ones only. Here, as there: such a tensor is received as it is, and the
    stage before waits for no gradient of it."""
    from torch.distributed.pipelining import stage as torch_stage

    if RELEASE >= (2, 12):
        return stage
    prepare, recv_ops = stage._prepare_forward_infra, stage._get_recv_ops

    def prepare_marking_floating(num_microbatches: int, args: Any, kwargs: Any = None) -> Any:
        had_backward = stage.has_backward
        stage.has_backward = False  # torch 2.11 would mark every receive buffer
        try:
            outputs = prepare(num_microbatches, args, kwargs)
        finally:
            stage.has_backward = had_backward
        for infos in stage.args_recv_info.values() if had_backward else ():
            for info in infos:
                if isinstance(info, torch_stage._RecvInfo) and _floating(info.buffer):
                    info.buffer.requires_grad_(True)
        return outputs

    def awaited(info: Any) -> bool:  # not the gradient of a tensor that is not floating
        gradient = isinstance(info, torch_stage._RecvInfo) and info.input_name.startswith("recv_grad_for_")
        return not gradient or _floating(info.buffer)

    def recv_ops_floating(recv_infos: tuple) -> list[Any]:
        return recv_ops(tuple(info for info in recv_infos if awaited(info)))

    def set_forward_input(prev_stage_outputs: Any, mb_index: int) -> None:
        outputs = torch_stage._normalize_model_output_as_tuple(prev_stage_outputs)
        for info, tensor in zip(stage.args_recv_info[mb_index], outputs):
            info.buffer = tensor.detach().requires_grad_(True) if _floating(tensor) else tensor.detach()

    def set_backward_input_floating(next_stage_bwd_outputs: tuple, mb_index: int) -> None:
        infos = stage.grad_recv_info[mb_index]
        kept = [(info, g) for info, g in zip(infos, next_stage_bwd_outputs) if g is not None or _floating(info.buffer)]
        for info, grad in kept:  # a floating input's missing gradient is refused, as torch refuses it
            if not isinstance(grad, torch.Tensor):
                raise AssertionError(f"expected tensor values as outputs from prev stage, got {type(grad)}")
            info.buffer = grad

    stage._prepare_forward_infra, stage._get_recv_ops = prepare_marking_floating, recv_ops_floating
    stage.set_local_fwd_input = set_forward_input
    stage.set_local_bwd_input = set_backward_input_floating
    return stage


def shape_inference_uncompiled(stage: Any) -> Any:
    """``stage`` whose first-step shape inference runs its compiled layers eagerly.

    torch 2.11 infers shapes by a forward under ``no_grad``: compiled layers (``compile=True``) compiled a graph for
    it, a second one per batch signature that training never runs (torch >= 2.12 infers under the training step's
    own grad mode). The shapes are the same eagerly."""
    if RELEASE >= (2, 12):
        return stage
    infer = stage._shape_inference

    def infer_eagerly(*args: Any, **kwargs: Any) -> Any:
        with torch.compiler.set_stance("force_eager"):
            return infer(*args, **kwargs)

    stage._shape_inference = infer_eagerly
    return stage


def weight_pass_exact() -> bool:
    """Whether torch's split backward computes the weight gradients its input pass left exactly (torch >= 2.13).

    torch 2.11 and 2.12's ``stage_backward_weight`` sum the gradients of an autograd node with several outputs into
    its first output, and back-propagate from several kept nodes of which one descends from another without holding
    the descendant's contribution back (counted twice); 2.11's also fails on a custom autograd Function's node
    ("Attribute '_input_metadata' is invalid", transformers' MoE experts). Where it is not exact the runtime runs the
    whole backward in the input pass (``runtime/split_backward.py``): the same gradients, without the split's overlap."""
    return RELEASE >= (2, 13)


def stager_kept_between_saves(stager: Any) -> Any:
    """``stager`` (a DCP ``DefaultStager`` that background saves share) keeping its copier between saves.

    torch 2.11 and 2.12 close the copier at the end of every ``stage``: its copies of the tensors are dropped (each
    save allocates the whole shard again) and its dispatch table cleared, so the next save stops at the first class
    object it copies (an optimizer state's ``defaultdict(dict)``: "KeyError: <class 'type'>"). torch >= 2.13 keeps
    both until the stager is closed."""
    if RELEASE >= (2, 13):
        return stager
    copier, stage = stager._state_dict_stager, stager._stage

    def stage_keeping(*args: Any, **kwargs: Any) -> Any:
        copier.close = lambda: None  # this instance's, for the one call
        try:
            return stage(*args, **kwargs)
        finally:
            del copier.close

    stager._stage = stage_keeping
    return stager


def release_differences(stage: Any) -> Any:
    """``stage`` (a ``PipelineStage``) behaving alike on every supported release: each shim above that applies."""
    stage = buffers_kept_through_metadata_inference(shape_inference_uncompiled(stage))
    stage = non_floating_tensors_received(warm_up_without_self_sends(stage))
    return no_gradient_for_tensors_that_need_none(stage)
