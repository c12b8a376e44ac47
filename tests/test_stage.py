import os
import sys
import weakref

import pytest
import torch
from torch import nn

sys.path.insert(0, os.path.dirname(__file__))

from models import HFBertClassifier, ListGPT, TinyGPT  # noqa: E402

from lightning_pp.errors import PipelineConfigError  # noqa: E402
from lightning_pp.examples.gpt import GPT  # noqa: E402
from lightning_pp.layout.options import PipelineOptions  # noqa: E402
from lightning_pp.memory.recompute import checkpoint_layers  # noqa: E402
from lightning_pp.split.microbatch import ModelCall  # noqa: E402
from lightning_pp.split.planning import learn_placement  # noqa: E402
from lightning_pp.split.pruned import unprunable  # noqa: E402
from lightning_pp.split.stage import (  # noqa: E402
    Tie,
    find_layers,
    plan_placement,
    prune_to_stages,
    replace_in_view,
    resolve_layers,
    stage_view,
    trace_forward,
)


def place(module, path, n_stages, inputs, balance=None):
    trace = trace_forward(module, path, lambda: module(inputs))
    return plan_placement(module, path, n_stages, balance, trace)


class HeadFirst(nn.Module):
    """Attribute order says head, norm, layers, embedding; forward order says the opposite."""

    def __init__(self, mid: bool = False) -> None:
        super().__init__()
        self.head = nn.Linear(8, 5)
        self.norm = nn.LayerNorm(8)
        self.layers = nn.ModuleDict({str(i): nn.Linear(8, 8) for i in range(4)})
        self.mid = nn.LayerNorm(8) if mid else None
        self.embed = nn.Embedding(5, 8)
        self.drop = nn.Dropout(0.0)
        self.loss_fn = nn.CrossEntropyLoss()

    def forward(self, x):
        h = self.drop(self.embed(x)) if self.embed is not None else x
        for key, layer in self.layers.items():
            h = layer(h)
            if key == "1" and self.mid is not None:
                h = self.mid(h)
        h = self.norm(h) if self.norm is not None else h
        return self.head(h) if self.head is not None else h


def test_parts_are_placed_by_forward_order_not_attribute_order():
    p = place(HeadFirst(), "layers", 2, torch.zeros(2, 3, dtype=torch.long))
    assert p.parts["embed"] == (0,) and p.parts["drop"] == (0,)
    assert p.parts["norm"] == (1,) and p.parts["head"] == (1,)
    assert p.parts["loss_fn"] == (0, 1)  # forward never calls it and it has no parameters: every stage
    assert p.layers_of(0) == ["0", "1"] and p.layers_of(1) == ["2", "3"]


def test_a_part_between_layers_follows_the_layer_before_it():
    p = place(HeadFirst(mid=True), "layers", 4, torch.zeros(2, 3, dtype=torch.long))
    assert p.parts["mid"] == (1,)


def test_nested_layers_loose_parameter_and_unused_loss_module():
    model = TinyGPT(n_layers=4)
    p = place(model, "net.blocks", 2, torch.zeros(2, 8, dtype=torch.long))
    assert p.parts == {"final_norm": (1,), "criterion": (0, 1), "net.embed": (0,), "net.head": (1,)}
    assert p.params == {"net.pos": (0,)}


def test_prune_keeps_names_and_splits_every_parameter_once():
    full = GPT(n_layers=4)
    keys = set(full.state_dict())
    p = place(full, "layers", 2, torch.zeros(2, 8, dtype=torch.long))
    stages = []
    for s in range(2):
        module = GPT(n_layers=4)
        module.load_state_dict(full.state_dict())
        prune_to_stages(module, p, [s])
        stages.append(module.state_dict())
    assert set(stages[0]).isdisjoint(stages[1])
    assert set(stages[0]) | set(stages[1]) == keys
    assert "tok_embeddings.weight" in stages[0] and "output.weight" in stages[1]
    assert "layers.3.layer.linear1.weight" in stages[1]


def test_an_unused_part_with_parameters_lives_on_the_last_stage():
    model = HeadFirst()
    model.aux = nn.Linear(8, 8)  # used only by the step, never by forward
    p = place(model, "layers", 3, torch.zeros(2, 3, dtype=torch.long))
    assert p.parts["aux"] == (2,)


def test_balance_parameters_moves_layers_away_from_a_heavy_head():
    model = GPT(vocab=64, dim=32, n_layers=8, n_heads=4)
    model.output = nn.Linear(32, 20000)  # a vocabulary head far heavier than the embedding
    p = place(model, "layers", 2, torch.zeros(1, 4, dtype=torch.long), balance="parameters")
    assert p.counts[0] > p.counts[1]
    assert place(model, "layers", 2, torch.zeros(1, 4, dtype=torch.long)).counts == (4, 4)


def test_a_tied_embedding_and_head_are_held_by_both_stages():
    model = GPT(n_layers=2)
    model.output.weight = model.tok_embeddings.weight
    p = place(model, "layers", 2, torch.zeros(1, 4, dtype=torch.long))
    assert p.ties == (Tie(("tok_embeddings.weight", "output.weight"), ((0,), (1,))),)
    assert p.ties[0].source == 0 and p.ties[0].names_on(1) == ["output.weight"]
    assert "shared by stages [0, 1] (gradients summed): tok_embeddings.weight = output.weight" in p.describe(model)


def test_a_parameter_used_on_two_stages_is_held_by_both():
    class Shared(HeadFirst):
        def __init__(self):
            super().__init__()
            self.scale = nn.Parameter(torch.ones(8))

        def forward(self, x):
            h = self.embed(x) * self.scale
            for layer in self.layers.values():
                h = layer(h)
            return self.head(self.norm(h) * self.scale)

    p = place(Shared(), "layers", 3, torch.zeros(1, 3, dtype=torch.long))
    assert p.params["scale"] == (0, 2) and p.ties == (Tie(("scale",), ((0, 2),)),)


def test_a_stand_in_parameter_replaces_a_tied_one_in_one_view_only():
    model = GPT(n_layers=4)
    model.output.weight = model.tok_embeddings.weight
    p = place(model, "layers", 2, torch.zeros(1, 4, dtype=torch.long))
    first, last = stage_view(model, p, [0]), stage_view(model, p, [1])
    stand_in = nn.Parameter(model.output.weight.detach())
    replace_in_view(last, "output.weight", stand_in)
    assert last.output.weight is stand_in and stand_in.data_ptr() == model.output.weight.data_ptr()
    assert model.output.weight is model.tok_embeddings.weight is first.tok_embeddings.weight


def test_layers_called_out_of_dict_order_are_refused():
    class Reversed(HeadFirst):
        def forward(self, x):
            h = self.embed(x)
            for layer in reversed(list(self.layers.values())):
                h = layer(h)
            return self.head(h)

    with pytest.raises(PipelineConfigError, match=r"in the order \['3', '2', '1', '0'\]"):
        place(Reversed(), "layers", 2, torch.zeros(1, 3, dtype=torch.long))


def test_find_layers_errors_name_the_value_and_the_fix():
    model = GPT(n_layers=2)
    with pytest.raises(
        PipelineConfigError, match=r"layers='blocks'.*has no attribute 'blocks'.*layers='layers'.*\['layers'\]"
    ):
        find_layers(model, "blocks")
    with pytest.raises(PipelineConfigError, match=r"layers='norm' is a LayerNorm, not an nn.ModuleList, nn.Sequ"):
        find_layers(model, "norm")


class _Moe(nn.Module):
    def __init__(self, d: int) -> None:
        super().__init__()
        self.norm = nn.LayerNorm(d)
        self.experts = nn.ModuleList(
            nn.Sequential(nn.Linear(d, 2 * d), nn.GELU(), nn.Linear(2 * d, d)) for _ in range(4)
        )


class _Unnamed(nn.Module):
    """A user's own names: a stem, an ``encoder`` of MoE blocks (each holding a list of experts), a head."""

    def __init__(self, decoder: int = 0) -> None:
        super().__init__()
        self.stem = nn.Sequential(nn.Linear(4, 8), nn.LayerNorm(8), nn.ReLU())  # mixed types: not repeated layers
        self.encoder = nn.Sequential(*(_Moe(8) for _ in range(3)))
        self.decoder = nn.ModuleList(_Moe(8) for _ in range(decoder))
        self.head = nn.Linear(8, 2)


def test_the_layers_are_found_when_not_named():
    assert resolve_layers(_Unnamed(), None) == "encoder"
    assert resolve_layers(_Unnamed(decoder=1), None) == "encoder"  # one block: nothing to split
    mlp = nn.Sequential(nn.Linear(4, 16), nn.ReLU(), nn.Linear(16, 16), nn.ReLU(), nn.Linear(16, 2))
    assert resolve_layers(nn.ModuleDict({"net": mlp, "loss": nn.CrossEntropyLoss()}), None) == "net"
    assert resolve_layers(GPT(n_layers=2), None) == "layers"
    cnn = nn.Sequential(nn.Conv2d(1, 4, 3), nn.BatchNorm2d(4), nn.ReLU(), nn.Flatten(), nn.Linear(4, 2))
    assert resolve_layers(nn.ModuleDict({"features": cnn}), None) == "features"  # of mixed layers, with none alike
    with pytest.raises(PipelineConfigError, match=r"two containers.*'encoder' \(3,408 parameters\) and 'decoder' \("):
        resolve_layers(_Unnamed(decoder=2), None)
    with pytest.raises(PipelineConfigError, match=r"Linear holds no nn.ModuleList.*PipelineStrategy\(layers=...\)"):
        resolve_layers(nn.Linear(2, 2), None)


class _CallsEveryPart(HeadFirst):
    def forward(self, x):
        h = self.embed(x)
        for layer in self.layers.values():
            h = layer(h)
        return self.head(self.norm(h))


class _IndexesLayers(HeadFirst):
    def forward(self, x):
        h = self.embed(x) if self.embed is not None else x
        for i in range(len(self.layers)):
            h = self.layers[str(i)](h) if isinstance(self.layers, nn.ModuleDict) else self.layers[i](h)
        return self.head(h) if self.head is not None else h


class _CountsLayers(HeadFirst):
    def forward(self, x):
        h = self.embed(x) if self.embed is not None else x
        for i, layer in enumerate(self.layers.values()):  # the stage's layers, counted from 0 on every stage
            h = layer(h) * (1.0 + 0.1 * i)
        return self.head(h) if self.head is not None else h


class _ReadsTheHeadsOutput(HeadFirst):
    def forward(self, x):
        h = self.embed(x) if self.embed is not None else x
        for layer in self.layers.values():
            h = layer(h)
        outputs = (h,) if self.head is None else (h, self.head(h))
        return outputs[1]  # as Hugging Face's classifiers read their pooler's output


@pytest.mark.parametrize("where", ["real", "meta"])
def test_a_forward_that_cannot_run_a_pruned_stage_is_found(where):
    # split=None traces such a forward; one that skips None parts keeps split="prune"; a forward that computes
    # another result stage by stage (found for real only) is refused under split="prune"
    x = torch.zeros(2, 3, dtype=torch.long)
    listed = _IndexesLayers()
    listed.layers = nn.ModuleList(listed.layers.values())
    cases = [
        (HeadFirst(), None),
        (_CallsEveryPart(), "forward calls the parts other stages hold instead of skipping them (on stage 0, where"),
        (listed, "forward indexes the layers by position (on stage 1: Layer 0 is not on this pipeline stage"),
        (
            _CountsLayers(),
            "forward's result run stage by stage differs from its result whole (by up to" if where == "real" else None,
        ),
        (
            _ReadsTheHeadsOutput(),
            "forward fails run stage by stage though it runs whole (on stage 0, where ['head', 'norm'] are None:"
            " IndexError",
        ),
    ]
    for module, found in cases:
        placement = place(module, "layers", 2, x)
        if where == "meta":
            module.to("meta")
        said = unprunable(module, placement, ModelCall("", (x.to(where if where == "meta" else "cpu"),), {}))
        assert said == found or said.startswith(found), said
        assert all(p.is_meta == (where == "meta") for p in module.parameters())
        assert module.training


def test_a_hf_classifier_whose_stages_cannot_run_pruned_is_traced_or_refused_under_split_prune():
    # BertForSequenceClassification skips no part yet fails on a stage without its pooler (outputs[1]): it
    # trained only traced; split="prune" failed at the first step with the model's IndexError
    batch = {"tokens": torch.randint(0, 32, (4, 8)), "targets": torch.randint(0, 32, (4, 8))}

    def learn(split):
        options = PipelineOptions(split=split)
        return learn_placement(HFBertClassifier(), options, 2, "training_step", (batch, 0), {}, 2, torch.device("cpu"))

    placement, tracer = learn(None)
    assert tracer is not None and placement.counts == (2, 2)
    with pytest.raises(PipelineConfigError, match=r"fails run stage by stage.*IndexError.*pass split='trace'"):
        learn("prune")


@pytest.mark.parametrize("container", [nn.ModuleList, nn.Sequential])
def test_a_pruned_list_keeps_global_names_and_refuses_positional_indexing(container):
    model = ListGPT(n_layers=4)
    model.net.blocks = container(*model.net.blocks) if container is nn.Sequential else model.net.blocks
    placement = place(model, "net.blocks", 2, torch.zeros(2, 8, dtype=torch.long))
    view = stage_view(model, placement, [1])  # the whole module stays whole
    prune_to_stages(model, placement, [1])
    blocks = model.net.blocks
    assert isinstance(blocks, container) and type(blocks).__qualname__ == container.__qualname__
    assert [n for n, _ in blocks.named_children()] == ["2", "3"] and len(blocks) == 2
    assert {k.split(".")[2] for k in model.state_dict() if k.startswith("net.blocks.")} == {"2", "3"}
    assert blocks[3] is list(blocks)[1]  # an integer names the global layer
    with pytest.raises(IndexError, match=r"Layer 0 is not on this pipeline stage, which holds layers \['2', '3'\]"):
        blocks[0]
    assert len(blocks[:1]) == 1  # slices stay positional over the stage's layers
    assert [n for n, _ in view.net.blocks.named_children()] == ["2", "3"]


def test_activation_checkpointing_recomputes_each_layer_with_equal_gradients():
    def build():
        torch.manual_seed(0)
        return nn.ModuleDict({str(i): nn.Sequential(nn.Linear(16, 64), nn.Dropout(0.2), nn.GELU()) for i in range(3)})

    def run(layers):
        calls, saved = [], []
        for layer in layers.values():
            layer[0].register_forward_hook(lambda *_: calls.append(1))
        torch.manual_seed(1)
        x = torch.randn(4, 16, requires_grad=True)
        with torch.autograd.graph.saved_tensors_hooks(lambda t: saved.append(t.numel()) or t, lambda t: t):
            h = x
            for layer in layers.values():
                h = layer(h)[:, :16]
        h.pow(2).sum().backward()
        return [p.grad for p in layers.parameters()], x.grad, len(calls), sum(saved)

    plain, recomputed = build(), build()
    keys = list(recomputed.state_dict())
    checkpoint_layers(recomputed)
    grads, x_grad, calls, saved = run(plain)
    grads_ckpt, x_grad_ckpt, calls_ckpt, saved_ckpt = run(recomputed)
    assert list(recomputed.state_dict()) == keys  # names unchanged
    assert calls_ckpt == 2 * calls == 6  # each layer ran again in backward (dropout replayed: equal grads)
    assert all(torch.equal(a, b) for a, b in zip(grads, grads_ckpt)) and torch.equal(x_grad, x_grad_ckpt)
    assert saved_ckpt < saved / 2


def test_activation_checkpointing_recomputes_once_under_a_split_backward():
    # the zero-bubble and V schedules' backward: an input pass, then weight passes over the same saved tensors
    from torch.distributed.pipelining._backward import stage_backward_input, stage_backward_weight

    calls: list[int] = []

    def build():
        torch.manual_seed(0)
        layers = nn.ModuleDict({str(i): nn.Sequential(nn.Linear(16, 16), nn.ReLU(), nn.Dropout(0.2)) for i in range(3)})
        for layer in layers.values():
            layer[0].register_forward_hook(lambda *_: calls.append(1))
        return layers

    def run(layers):
        calls.clear()
        torch.manual_seed(1)
        x = torch.randn(4, 16, requires_grad=True)
        h = x
        for layer in layers.values():
            h = layer(h)
        (x_grad,), groups = stage_backward_input([h], [torch.ones_like(h)], [x], layers.parameters())
        stage_backward_weight(layers.parameters(), groups)
        return [p.grad for p in layers.parameters()], x_grad, len(calls), weakref.ref(x)

    plain, per_pass, once = build(), build(), build()
    checkpoint_layers(per_pass)  # torch's checkpoint: what 1F1B and GPipe use
    checkpoint_layers(once, once=True)
    grads, x_grad, n_plain, _ = run(plain)
    assert run(per_pass)[2] == 3 * n_plain == 9  # recomputed once per pass
    grads_ckpt, x_grad_ckpt, n_ckpt, micro_batch = run(once)
    assert n_ckpt == 2 * n_plain == 6
    # nothing outlives the step: a recomputed ReLU that saved its own output once tied the graph into a cycle
    # Python's collector cannot see, keeping every micro-batch's activations (150 MiB per ZBV step here)
    assert micro_batch() is None
    assert all(torch.equal(a, b) for a, b in zip(grads, grads_ckpt)) and torch.equal(x_grad, x_grad_ckpt)
