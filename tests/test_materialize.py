"""Building on meta, the name rule for initial weights, and the errors of a module that cannot be built so
(in one process: the functions the strategy calls at its first batch)."""

from __future__ import annotations

import pytest
import torch
import torchmetrics
from models import InitGPT, ItemGPT, LoraLlama, TinyGPT
from torch import nn

from lightning_pp import PipelineConfigError, empty_weights, materialize
from lightning_pp.examples.gpt import GPT
from lightning_pp.layout.options import PipelineOptions
from lightning_pp.memory.materialize import check_initializers, materialized, on_meta
from lightning_pp.split.planning import learn_placement
from lightning_pp.split.profiling import count_flops
from lightning_pp.split.stage import find_layers, prune_to_stages

CPU = torch.device("cpu")
NET = PipelineOptions(layers="net.blocks")
CFG = dict(vocab=48, dim=32, n_layers=6, n_heads=4, seq_len=8)


def batch() -> tuple[torch.Tensor, torch.Tensor]:
    x = torch.randint(0, CFG["vocab"], (4, CFG["seq_len"]), generator=torch.Generator().manual_seed(0))
    return x, (x + 1) % CFG["vocab"]


def meta_gpt() -> GPT:
    with empty_weights():
        return GPT(**CFG)


def test_parameters_on_meta_buffers_real():
    model = meta_gpt()
    assert all(p.is_meta for p in model.parameters())
    mask = model.layers["0"].mask
    assert not mask.is_meta and torch.equal(mask, nn.Transformer.generate_square_subsequent_mask(CFG["seq_len"]))
    materialize(model)
    assert torch.equal(model.layers["3"].mask, mask)  # computed in __init__, survives materialisation
    assert not any(p.is_meta for p in model.parameters())


@pytest.mark.parametrize("n_stages", [2, 3])
def test_each_stage_gets_the_whole_models_initial_weights(n_stages):
    whole = materialize(meta_gpt(), seed=7)
    expected = whole.state_dict()
    assert not torch.equal(expected["layers.0.layer.linear1.weight"], expected["layers.1.layer.linear1.weight"])
    # MultiheadAttention's own initialiser runs after its out_proj's, as in eager construction
    assert torch.count_nonzero(expected["layers.0.layer.self_attn.out_proj.bias"]) == 0
    seen: dict[str, torch.Tensor] = {}
    for stage in range(n_stages):
        model = meta_gpt()
        placement, _ = learn_placement(
            model, PipelineOptions(layers="layers"), n_stages, "training_step", (batch(), 0), {}, 2, torch.device("cpu")
        )
        prune_to_stages(model, placement, [stage])
        optimizer = torch.optim.SGD(model.parameters(), lr=0.1)  # built on meta, as configure_optimizers may be
        torch.manual_seed(123)
        rng = torch.get_rng_state()
        materialize(model, seed=7)
        assert torch.equal(torch.get_rng_state(), rng)  # the global random stream is untouched
        assert all(not p.is_meta for group in optimizer.param_groups for p in group["params"])
        held = model.state_dict()
        assert len(held) < len(expected)
        seen.update(held)
    assert set(seen) == set(expected)
    for name, tensor in expected.items():
        assert torch.equal(seen[name], tensor), name


def test_ties_and_identities_survive_materialisation():
    class Tied(nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.embed = nn.Embedding(10, 4)
            self.head = nn.Linear(4, 10, bias=False)
            self.head.weight = self.embed.weight

    with empty_weights():
        model = Tied()
    weight = model.embed.weight
    materialize(model)
    assert model.head.weight is model.embed.weight is weight and not weight.is_meta


def test_a_module_without_initialiser_is_an_error_naming_it_and_init_fn_is_the_fix():
    with empty_weights():
        model = TinyGPT()  # Net owns the loose `pos` parameter and has no reset_parameters
    with pytest.raises(PipelineConfigError, match=r"no initialiser: 'net' \(Net: \['pos'\]\).*init_fn"):
        check_initializers(model)

    def init_fn(module: nn.Module, name: str) -> None:
        if name == "net":
            nn.init.zeros_(module.pos)
        else:
            module.reset_parameters()

    materialize(model, init_fn=init_fn)
    assert torch.count_nonzero(model.net.pos) == 0 and torch.count_nonzero(model.net.head.weight) > 0


def test_metrics_built_on_meta_are_refused():
    with torch.device("meta"):
        metric = torchmetrics.classification.MulticlassAccuracy(4)
    model = nn.Module()
    model.acc = metric
    with pytest.raises(PipelineConfigError, match=r"torchmetrics object 'acc'.*meta device"):
        check_initializers(model)


def test_a_forward_that_reads_values_cannot_be_traced_on_meta():
    with empty_weights():
        model = ItemGPT()
    tokens = {"tokens": torch.zeros(4, 8, dtype=torch.long), "targets": torch.zeros(4, 8, dtype=torch.long)}
    with pytest.raises(PipelineConfigError, match=r"cannot run without data \(in ItemGPT.forward itself.*item"):
        learn_placement(model, NET, 2, "training_step", (tokens, 0), {}, 2, CPU)
    # an eagerly built module is traced on meta too (its real tensors swapped out and back), or for real if
    # its forward needs values
    for eager in (InitGPT(), ItemGPT()):
        before = {k: v.clone() for k, v in eager.state_dict().items()}
        placement, _ = learn_placement(eager, NET, 2, "training_step", (tokens, 0), {}, 2, CPU)
        assert placement.counts == (2, 2)
        assert all(torch.equal(before[k], v) and not v.is_meta for k, v in eager.state_dict().items())


def test_flops_on_meta_cost_each_layer_without_memory():
    model = meta_gpt()
    x, _ = batch()
    with on_meta(model) as to_meta:
        costs = count_flops(model, find_layers(model, "layers"), model.forward, to_meta((x,)), {})
    assert len(set(costs.layers)) == 1 and costs.layers[0] > 0  # identical layers cost the same
    assert costs.last > 0  # norm and vocabulary head
    assert all(p.is_meta and p.grad is None for p in model.parameters())


@pytest.mark.parametrize("model", [InitGPT, LoraLlama])
def test_a_model_materialised_for_a_while_goes_back_to_meta_as_it_was(model):
    # schedule="auto" times a meta build that fits on the device with real weights, then each rank materialises its
    # own stage from meta: the Parameters (which the optimizer holds), their attributes and the buffers stay
    with empty_weights():
        built = model(n_layers=2)
    params = {n: (p, p.requires_grad, dict(p.__dict__)) for n, p in built.named_parameters()}
    buffers = dict(built.named_buffers())
    with materialized(built, torch.device("cpu")):
        assert not any(p.is_meta for p in built.parameters())
        seen = {n: p.detach().clone() for n, p in built.named_parameters()}
    assert {n: (p, p.requires_grad, dict(p.__dict__)) for n, p in built.named_parameters()} == params
    assert all(p.is_meta for p in built.parameters()) and dict(built.named_buffers()) == buffers
    materialize(built)  # the weights it was timed with were the pipeline's own initial ones
    assert all(torch.equal(p, seen[n]) for n, p in built.named_parameters())
