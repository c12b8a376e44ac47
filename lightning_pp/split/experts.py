"""Experts sharded over the replicas of a stage (``expert_parallel_size``), tokens dispatched by all-to-all.

The experts module is transformers' (``@use_experts_implementation``: Mixtral, Qwen2/3-MoE, OLMoE, gpt-oss,
DeepSeek-V3): ``forward(hidden (T, H), top_k_index (T, k), top_k_weights (T, k))`` over parameters whose first
dimension is the expert. Each rank of a stage's replicas holds ``num_experts / E`` of them as a ``Shard(0)``
DTensor over the replicas' mesh, so initialisation, ``init_weights``, checkpoints and clipping see the
one-process tensor (PP outside EP, as torchtitan). A forward sends each (token, expert) pair to the rank holding
the expert, runs transformers' own experts arithmetic there on the local experts, and sends the results back;
the all-to-all's backward returns the gradients the same way.

Each rank's experts receive the tokens of every replica, so their gradients sum over the replicas where DDP
averages the rest: a factor ``1 / E`` on the experts' gradients keeps the two alike (and any loss weighting
across replicas with them).

A traced model runs aten graphs, not the modules: while tracing, the experts call a custom op (an opaque node
with a fake kernel); each rank's pieces then call :func:`routed` in its place, on the adopted tensors. Experts
with LoRA on their own weights (peft's ``target_parameters``) are that op too, where the pieces run the experts on
each stack plus its adapters' product (:func:`_own_forward`).
"""

from __future__ import annotations

import types
from typing import Any

import torch
import torch.distributed as dist
from torch import fx, nn
from torch.distributed._functional_collectives import all_to_all_single_autograd
from torch.distributed.tensor import DTensor, Shard, distribute_tensor

from lightning_pp.checkpoints.adapters import BASE_LAYER, is_parameter_wrapper
from lightning_pp.errors import PipelineConfigError
from lightning_pp.memory.materialize import without_data
from lightning_pp.split.peft_trace import adapted_tensors
from lightning_pp.split.stage import get_path


@torch.library.custom_op("lightning_pp::experts", mutates_args=())
def _experts_op(
    hidden: torch.Tensor, top_k_index: torch.Tensor, top_k_weights: torch.Tensor, weights: list[torch.Tensor], path: str
) -> torch.Tensor:
    raise RuntimeError(f"lightning_pp::experts ({path}) runs only in a trace; its pieces call the module at {path}")


@_experts_op.register_fake
def _(hidden, top_k_index, top_k_weights, weights, path):  # type: ignore[no-untyped-def]
    return torch.empty_like(hidden)


def is_experts(module: nn.Module) -> bool:
    """transformers' experts modules: ``@use_experts_implementation`` gives them the layout of their weights
    (``has_gate``, ``is_concatenated``, ``is_transposed``; transformers 5.17 and later alike)."""
    marks = ("has_gate", "is_concatenated", "is_transposed")
    return all(hasattr(module, mark) for mark in marks) and isinstance(getattr(module, "num_experts", None), int)


def eager_experts_fix(model: nn.Module) -> str:
    """What to change when the model's experts run transformers' ``experts_implementation="eager"``: a Python
    loop over the experts that tokens were routed to (``nonzero``), whose length only the data decides, so neither
    a trace nor tensors without data can run it. transformers' own implementations of the same arithmetic,
    ``"grouped_mm"`` (its default) and ``"batched_mm"``, have no such loop. Empty where no experts run eagerly."""
    eager = [
        name
        for name, module in model.named_modules()
        if is_experts(module) and getattr(getattr(module, "config", None), "_experts_implementation", None) == "eager"
    ]
    if not eager:
        return ""
    return (
        f"Its experts ({eager[0]}{f' and {len(eager) - 1} more' if len(eager) > 1 else ''}) run"
        " experts_implementation='eager', a loop over the experts each batch routes tokens to, which only the data"
        " decides: build or load the model with experts_implementation='grouped_mm' (transformers' default) or"
        " 'batched_mm' (`from_pretrained(..., experts_implementation='grouped_mm')`)"
    )


def fallback_backward_fix(model: nn.Module) -> str:
    """What to change when a model's experts must be costed without data on transformers before 5.23: there the
    backward of the float32 experts' grouped matmul (``grouped_mm_fallback``) is Python reading each expert's token
    count to the host (``offs.tolist()``), which meta and fake tensors do not have; 5.23 made it a custom op with a
    kernel for them. Empty where it does not apply."""
    import transformers

    release = tuple(int(n) for n in transformers.__version__.split(".")[:2])
    if release >= (5, 23) or not any(is_experts(m) for m in model.modules()):
        return ""
    return (
        f"Its experts' backward in transformers {transformers.__version__} (the grouped matmul's fallback for float32"
        " weights) reads how many tokens each expert got, which a model costed without data does not have: install"
        " transformers>=5.23, or give balance= a list of layer counts (and schedule=, n_microbatches= for"
        " schedule='auto')"
    )


def route_experts(module: nn.Module, size: int) -> list[str]:
    """Every experts module of ``module`` dispatches its tokens over ``size`` ranks once its parameters are
    sharded (:func:`shard_experts`); before that (the placement's forward) it runs as it did. Returns their names.
    The same on every rank, before any collective."""
    found = {name: m for name, m in module.named_modules() if is_experts(m)}
    if not found:
        raise PipelineConfigError(
            f"expert_parallel_size={size}, but {type(module).__name__} holds no experts module transformers'"
            " @use_experts_implementation makes (forward(hidden, top_k_index, top_k_weights), parameters"
            " [num_experts, ...]). Use expert_parallel_size=1 (the default) for a dense model."
        )
    adapted = list(adapted_experts(module))
    if adapted:
        raise PipelineConfigError(
            f"expert_parallel_size={size} with LoRA on the experts' own weights ({adapted[0]}: peft's"
            " target_parameters), whose product peft adds to each whole weight: a rank holding some of the experts"
            " cannot take it. Use expert_parallel_size=1, or leave the experts out of target_parameters."
        )
    for name, experts in found.items():
        n = experts.num_experts
        wrong = [f"{p}{list(t.shape)}" for p, t in experts.named_parameters() if "." in p or t.shape[:1] != (n,)]
        if n % size or wrong:
            raise PipelineConfigError(
                f"expert_parallel_size={size} cannot shard {name} ({type(experts).__name__}): it has {n} experts"
                + (f" and parameters not led by the expert dimension ({', '.join(wrong)})" if wrong else "")
                + f". Choose an expert_parallel_size that divides {n}, or 1."
            )
        experts.forward = types.MethodType(_forward, experts)  # type: ignore[method-assign]
        experts._routed_path = name
    return list(found)


def shard_experts(module: nn.Module, mesh: Any) -> int:
    """The experts parameters ``module`` holds as ``Shard(0)`` DTensors over ``mesh`` (meta ones stay meta, to
    be drawn whole by the initialisers); returns how many modules."""
    count = 0
    for experts in module.modules():
        if not hasattr(experts, "_routed_path"):
            continue
        for name, p in list(experts.named_parameters(recurse=False)):
            if not isinstance(p, DTensor):
                piece = distribute_tensor(p.detach(), mesh, [Shard(0)], src_data_rank=None)
                experts._parameters[name] = nn.Parameter(piece, requires_grad=p.requires_grad)
        count += 1
    return count


def is_routed(p: torch.Tensor) -> bool:
    """A parameter of experts sharded over the replicas (no other DTensor lives on their mesh under DDP): DDP
    does not average it, each rank holding its own."""
    return isinstance(p, DTensor) and p.device_mesh.mesh_dim_names == ("data_parallel",)


def _forward(self: nn.Module, hidden: torch.Tensor, top_k_index: torch.Tensor, top_k_weights: torch.Tensor) -> Any:
    weights = [p for _, p in self.named_parameters(recurse=False)]
    if without_data(hidden):
        return _experts_op(hidden, top_k_index, top_k_weights, weights, self._routed_path)
    if not isinstance(weights[0], DTensor):  # not sharded yet: the placement's forward on the CPU
        return type(self).forward(self, hidden, top_k_index, top_k_weights)
    return routed(self, hidden, top_k_index, top_k_weights, weights)


class _Local:
    """The experts module as transformers' experts functions read it, holding this rank's experts only."""

    def __init__(self, experts: nn.Module, weights: dict[str, torch.Tensor], n_local: int) -> None:
        self.__dict__.update(weights, _experts=experts, num_experts=n_local)

    def __getattr__(self, name: str) -> Any:
        return getattr(self._experts, name)


class _ScaleGrad(torch.autograd.Function):
    @staticmethod
    def forward(ctx: Any, t: torch.Tensor, factor: float) -> torch.Tensor:  # type: ignore[override]
        ctx.factor = factor
        return t.view_as(t)

    @staticmethod
    def backward(ctx: Any, grad: torch.Tensor) -> tuple[torch.Tensor, None]:  # type: ignore[override]
        return grad * ctx.factor, None


def routed(
    experts: nn.Module,
    hidden: torch.Tensor,
    top_k_index: torch.Tensor,
    top_k_weights: torch.Tensor,
    weights: list[torch.Tensor],
) -> torch.Tensor:
    """The experts' output for this rank's tokens, each (token, expert) pair computed on the rank holding it."""
    mesh = weights[0].device_mesh
    group, size = mesh.get_group(), mesh.size()
    names = [n for n, _ in experts.named_parameters(recurse=False)]
    local = {n: _ScaleGrad.apply(w.to_local(), 1.0 / size) if w.requires_grad else w.to_local()
             for n, w in zip(names, weights)}  # fmt: skip
    n_local = experts.num_experts // size
    tokens, k = top_k_index.shape
    flat = top_k_index.reshape(-1)
    owner = torch.div(flat, n_local, rounding_mode="floor")
    order = torch.argsort(owner, stable=True)
    send = torch.bincount(owner, minlength=size)
    recv = torch.empty_like(send)
    dist.all_to_all_single(recv, send, group=group)
    send_sizes, recv_sizes = send.tolist(), recv.tolist()
    ids = (flat % n_local)[order]
    their_ids = ids.new_empty(sum(recv_sizes))
    dist.all_to_all_single(their_ids, ids, recv_sizes, send_sizes, group=group)
    rows = hidden[torch.div(order, k, rounding_mode="floor")]
    theirs = all_to_all_single_autograd(rows, recv_sizes, send_sizes, group)  # torchtitan's dispatch
    ones = theirs.new_ones(theirs.shape[0], 1)
    out = type(experts).forward(_Local(experts, local, n_local), theirs, their_ids.unsqueeze(-1), ones)
    back = all_to_all_single_autograd(out, send_sizes, recv_sizes, group)
    pairs = torch.zeros_like(back).index_copy(0, order, back)
    weighted = pairs.view(tokens, k, -1) * top_k_weights.unsqueeze(-1).to(pairs.dtype)
    return weighted.sum(dim=1).to(hidden.dtype)


def adapted_experts(module: nn.Module) -> dict[str, nn.Module]:
    """peft's LoRA on experts' stacked weights (``target_parameters``): the outermost ``ParamWrapper`` around each
    experts module, by name. Its forward adds the adapters' product to the weight as a parametrization for the
    call, under ``torch.autocast`` of the weight's device, which no trace on meta records."""
    found = {}
    for name, m in module.named_modules():
        if not is_experts(m):
            continue
        outer = name
        while outer.endswith(BASE_LAYER) and is_parameter_wrapper(get_path(module, outer[: -len(BASE_LAYER)])):
            outer = outer[: -len(BASE_LAYER)]
        if outer != name:
            found[outer] = get_path(module, outer)
    return found


def opaque_adapted_experts(skeleton: nn.Module, prefix: str) -> list[str]:
    """In the trace of ``skeleton`` (at ``prefix`` in the LightningModule), each LoRA-adapted experts module is one
    op on its inputs and tensors, which each rank's pieces run on the rank's module (:func:`call_eager`). Returns
    the wrappers' names."""
    experts = adapted_experts(skeleton)
    for name, wrapper in experts.items():
        wrapper.forward = types.MethodType(_adapted_forward, wrapper)  # type: ignore[method-assign]
        wrapper._adapted_path = prefix + name
    return list(experts)


def _adapted_forward(
    self: nn.Module, hidden: torch.Tensor, top_k_index: torch.Tensor, top_k_weights: torch.Tensor
) -> Any:
    return _experts_op(hidden, top_k_index, top_k_weights, list(self.parameters()), self._adapted_path)


class _Eager(nn.Module):
    """What a traced piece calls where the trace recorded the experts op: ``run`` on the rank's module at
    the op's path, whose tensors the piece adopted by their own names."""

    def __init__(self, module: nn.Module, run: Any) -> None:
        super().__init__()
        self.__dict__.update(module=module, run=run)  # not a child: its tensors are the piece's, by their own names

    def forward(self, hidden: torch.Tensor, top_k_index: torch.Tensor, top_k_weights: torch.Tensor, weights: list,
                path: str) -> torch.Tensor:  # fmt: skip
        return self.run(self.module, hidden, top_k_index, top_k_weights, weights)


def call_eager(owner: fx.GraphModule, node: fx.Node, view: nn.Module) -> None:
    """``node`` (the traced experts op) calls the rank's module at the op's path: the sharded experts dispatch their
    tokens (:func:`routed`), LoRA-adapted experts add their adapters' products to their stacks."""
    module = get_path(view, node.args[4])
    name = f"_eager_{len(owner._modules)}"
    owner.add_module(name, _Eager(module, routed if hasattr(module, "_routed_path") else _own_forward))
    node.op, node.target = "call_module", name


def _own_forward(module: nn.Module, hidden: torch.Tensor, top_k_index: torch.Tensor, top_k_weights: torch.Tensor,
                 weights: list) -> torch.Tensor:  # fmt: skip
    """LoRA-adapted experts as peft's ``ParamWrapper`` computes them (:func:`adapted_tensors`), without the
    parametrization it registers on the experts module at each call, which dynamo cannot compile (a compiled layer
    recompiled it per layer until dynamo's limit, then ran eagerly)."""
    found = adapted_tensors(module)
    if found is None:
        return module(hidden, top_k_index, top_k_weights)
    experts, stacks = found
    return type(experts).forward(_Local(experts, stacks, experts.num_experts), hidden, top_k_index, top_k_weights)


@torch.library.custom_op("lightning_pp::experts_backward", mutates_args=())
def _backward_op(grad: torch.Tensor, top_k_index: torch.Tensor, weights: list[torch.Tensor]) -> list[torch.Tensor]:
    raise RuntimeError("lightning_pp::experts_backward is only counted, on tensors without data")


@_backward_op.register_fake
def _(grad, top_k_index, weights):  # type: ignore[no-untyped-def]
    return [torch.empty_like(grad), *(torch.empty_like(w) for w in weights)]


def _keep(ctx: Any, inputs: tuple, output: Any) -> None:
    ctx.save_for_backward(inputs[1], *inputs[3])


def _backward(ctx: Any, grad: torch.Tensor) -> tuple:
    """Only ever run without data, where the trace's pieces are counted (``balance="profile"``): the gradients'
    shapes, and an op that the FLOP counter counts (the router's share left out)."""
    top_k_index, *weights = ctx.saved_tensors
    hidden, *of_weights = _backward_op(grad, top_k_index, weights)
    return hidden, None, None, of_weights, None


_experts_op.register_autograd(_backward, setup_context=_keep)


def _pairs_flops(top_k_index: torch.Size, weights: list[torch.Size]) -> int:
    """Each (token, expert) pair through one expert's matrices (the stacks' last two dimensions); LoRA's product,
    once per call and small beside the tokens', is left out."""
    return 2 * top_k_index[0] * top_k_index[1] * sum(w[1] * w[2] for w in weights if len(w) == 3)


def _experts_flops(hidden: torch.Size, top_k_index: torch.Size, top_k_weights: torch.Size, weights: list[torch.Size],
                   *_: Any, **__: Any) -> int:  # fmt: skip
    return _pairs_flops(top_k_index, weights)


def _experts_backward_flops(grad: torch.Size, top_k_index: torch.Size, weights: list[torch.Size], **_: Any) -> int:
    """The input's gradient and the weights', each the forward's."""
    return 2 * _pairs_flops(top_k_index, weights)


EXPERTS_OP = torch.ops.lightning_pp.experts.default
EXPERTS_FLOPS = {  # for torch's FlopCounterMode: what the op in place of experts costs
    torch.ops.lightning_pp.experts: _experts_flops,
    torch.ops.lightning_pp.experts_backward: _experts_backward_flops,
}
