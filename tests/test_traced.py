"""``split="trace"``: Hugging Face's GPT2LMHeadModel, unchanged (a forward that skips no part, a tied embedding
and head, the loss computed inside the model), trains as one process trains it; and what cannot be traced fails
on every rank with the fix."""

from __future__ import annotations

import pytest
import torch
from conftest import ok, run_job
from models import HFGPT2, HFGPT2Cache, HFMoEEager, NanoGPT, transformers_at_least
from test_parity import LOSS_TOL, assert_same_logs, common
from test_tied import assert_state_equal, combined
from torch import nn
from transformers import GPTNeoConfig, GPTNeoForCausalLM

from lightning_pp.errors import PipelineConfigError
from lightning_pp.split.microbatch import ModelCall
from lightning_pp.split.stage import stage_view
from lightning_pp.split.traced import traced_placement

GPT2 = dict(model="gpt2", layers="model.transformer.h", split="trace", optimizer="sgd", lr=0.5, n_val=16)
TIE = ("model.transformer.wte.weight", "model.lm_head.weight")

SCENARIOS = {
    # labels= reach the last stage from the local batch; 36 samples: the last batch (4) is traced again; each
    # piece's layers recompute their activations in backward
    "labels-1f1b-2-recompute": dict(
        GPT2, schedule="1f1b", devices=2, m=2, batch=8, n_train=36, predict=True, activation_checkpointing=True
    ),
    # 3 stages, default micro-batches (6 per batch of 6, 4 for the last batch of 4); GPT2Config's default
    # use_cache=True (the traced copy runs without the cache, said once); balanced by the pieces' FLOPs
    "labels-gpipe-3-profile": dict(
        GPT2, model="gpt2_cache", schedule="gpipe", devices=3, m=None, batch=6, n_train=40, n_val=12, balance="profile"
    ),
    # the step's own cross-entropy from .logits; ZBV puts the embedding's and the head's stage on rank 0
    "logits-zbv-4": dict(GPT2, model="gpt2_logits", schedule="zbv", devices=2, m=4, batch=8, n_train=32),
}


@pytest.mark.parametrize("name", list(SCENARIOS))
def test_hf_gpt2_traced_trains_as_one_process(name, tmp_path, reference):
    cfg = SCENARIOS[name]
    job = ok(run_job({**cfg, "strategy": "pipeline"}, tmp_path / "job", timeout=240))
    ref = reference(**common(cfg))
    assert_same_logs(job.rank(0), ref, LOSS_TOL)
    assert job.output.count("shared by stages") == 1, job.output[-3000:]  # the tie, in the placement log
    assert job.output.count("the pipeline's traced copy runs with use_cache=False") == (cfg["model"] == "gpt2_cache")
    if cfg.get("balance") == "profile":  # the traced pieces' FLOPs on meta, logged once
        assert job.output.count("Profiled forward+backward per micro-batch (GFLOP, counted on meta)") == 1
    state = job.state()
    assert_state_equal(state, ref["state"], 1e-5)
    assert torch.equal(state[TIE[0]], state[TIE[1]])
    held = [set(job.rank(r)["params"]) for r in range(cfg["devices"])]
    # every rank freed what its stages do not hold: each layer on one rank, the tied weight on its holders
    assert sum(map(len, held)) <= len(set().union(*held)) + 1
    assert HFGPT2.load_from_checkpoint(job.out / "final.ckpt").model.lm_head.weight.shape == (32, 32)
    if cfg.get("predict"):  # predict_step's token ids, served on the last stage, handed to rank 0
        mine = torch.load(job.out / "predictions.pt", weights_only=False)
        theirs = torch.load(ref["out"] / "predictions.pt", weights_only=False)
        assert len(mine) == len(theirs) == 2 and all(torch.equal(a, b) for a, b in zip(mine, theirs))


def test_hf_gpt2_traced_with_replicas_trains_as_one_process_on_their_combined_batch(tmp_path, reference):
    # 2 replicas x 2 stages: pieces that change with the batch signature, averaged by the runner after the step
    cfg = dict(GPT2, schedule="1f1b", devices=4, pp=2, m=2, batch=4, n_train=32)
    job = ok(run_job({**cfg, "strategy": "pipeline"}, tmp_path / "job", timeout=300))
    ref = reference(**combined(cfg))
    # each replica logs its own loss (the model's step logs without sync_dist): their mean is the combined batch's
    replicas = zip(job.rank(0)["train"], job.rank(2)["train"], ref["train"], strict=True)
    assert len(ref["train"]) == 4
    assert max(abs((a["train_loss"] + b["train_loss"]) / 2 - c["train_loss"]) for a, b, c in replicas) <= LOSS_TOL
    state = job.state()
    assert_state_equal(state, ref["state"], 1e-5)
    assert torch.equal(state[TIE[0]], state[TIE[1]])


# transformers 5.17's OPT guards on a value its attention mask holds, which no trace can: refused (models.md)
OPT = pytest.param("opt", marks=pytest.mark.skipif(not transformers_at_least(5, 23), reason="OPT traces from 5.23"))


@pytest.mark.parametrize("model", ["llama", "olmo3", "vit", OPT, "gptj", "falcon"])
def test_hf_families_traced_train_as_one_process(model, tmp_path, reference):
    # the rotary embedding's @torch.no_grad() forward, traced as detached results (torch's unflattening drops the
    # arguments of a module called in a no-grad region); interleaved 1F1B: 4 stages on 2 ranks. Olmo3 calls its
    # rotary embedding twice (the trace's "rotary_emb@1" holds the model's own buffers; it used to be refused as
    # tensors made from values). Llama built on meta with the strategy's defaults: its layers found, and traced
    # since its forward needs values on meta (its masks). ViT with the defaults, built eagerly: traced since its
    # forward calls its classifier, its stages hand on an attention mask expanded over the batch (stride 0,
    # which gloo and NCCL refuse to send). OPT under ZBV: its layers return views, which the zero-bubble input pass
    # detaches in place. Olmo3 at lr 0.1: at GPT2's 0.5 its embedding drifted 2e-5 from one process on an AVX-512
    # CPU (float rounding amplified by momentum), 2e-7 at 0.1. GPT-J: each layer gathers its rotary table with the
    # position ids the stages hand on, which torch's shape inference made of torch.empty ("index 140240962395504
    # is out of bounds")
    given = {
        "olmo3": dict(layers="model.model.layers", lr=0.1),
        "llama": dict(layers=None, split=None, build="init_module"),
        "vit": dict(layers=None, split=None),
        "opt": dict(layers=None, split=None, schedule="zbv"),
        "gptj": dict(layers=None, split=None),
        "falcon": dict(layers=None, split=None, schedule="zbv"),
    }[model]
    cfg = dict(GPT2, model=model, optimizer="sgd", schedule="interleaved_1f1b", devices=2, m=4, batch=8) | given
    job = ok(run_job({**cfg, "n_train": 32, "strategy": "pipeline"}, tmp_path / "job", timeout=240))
    ref = reference(**common({**cfg, "n_train": 32}))
    assert_same_logs(job.rank(0), ref, LOSS_TOL)
    assert_state_equal(job.state(), ref["state"], 1e-5)
    if model == "llama":
        said = "Splitting 'model.model.layers' into stages: 4 layers (LlamaDecoderLayer)"
        assert job.output.count(said) == 1 and job.output.count("forward cannot run on meta tensors (") == 1
    if model == "vit":
        assert job.output.count("4 layers (ViTLayer)") == 1
        assert job.output.count("forward calls the parts other stages hold instead of skipping them") == 1


def test_hf_gpt2_traced_under_bf16_mixed_matches_one_process(tmp_path, reference):
    # traced in float32, run under autocast: the trace's dtype checks go, its conversions (logits.float()) stay
    cfg = dict(GPT2, schedule="1f1b", devices=2, m=2, batch=8, n_train=32, precision="bf16-mixed")
    job = ok(run_job({**cfg, "strategy": "pipeline"}, tmp_path / "job", timeout=240))
    assert_same_logs(job.rank(0), reference(**common(cfg)), 2e-2)  # as under split="prune" (test_parity)


def test_a_traced_checkpoint_resumes_under_another_layout_as_one_process(tmp_path, reference):
    # saved by 1F1B on 2 ranks (AdamW: its state must come back too), resumed by GPipe on 3 ranks and by one process
    first = dict(GPT2, optimizer="adamw", lr=1e-2, schedule="1f1b", devices=2, m=2, batch=8, n_train=32)
    ok(run_job({**first, "strategy": "pipeline"}, tmp_path / "first"))
    ckpt = str(tmp_path / "first" / "final.ckpt")
    resume = dict(first, schedule="gpipe", devices=3, m=None, batch=6, n_train=36, max_epochs=2, resume=ckpt)
    job = ok(run_job({**resume, "strategy": "pipeline"}, tmp_path / "resumed", timeout=240))
    assert_same_logs(job.rank(0), reference(**common(resume)), LOSS_TOL)


def test_what_cannot_be_traced_fails_on_every_rank_with_the_fix(tmp_path):
    for model, message in [
        ("gpt2_twice", "calls the model more than once"),
    ]:
        cfg = dict(GPT2, model=model, schedule="1f1b", devices=2, m=2, batch=8, n_train=16, timeout=30)
        job = run_job({**cfg, "strategy": "pipeline"}, tmp_path / model, timeout=120)
        assert job.returncode != 0 and job.seconds < 90, job.output[-3000:]
        assert message in job.output, job.output[-3000:]


class Branchy(nn.Module):
    """A forward whose control flow depends on values: it cannot be traced into a graph."""

    def __init__(self) -> None:
        super().__init__()
        self.layers = nn.ModuleList(nn.Linear(4, 4) for _ in range(2))

    def forward(self, x):
        for layer in self.layers:
            x = layer(x) if x.sum() > 0 else -layer(x)
        return x


class Made(nn.Module):
    """A forward that makes tensors from values: a number (as HF GPT-Neo's attention does) or a list."""

    def __init__(self, listed: bool = False) -> None:
        super().__init__()
        self.layers = nn.ModuleList(nn.Linear(4, 4) for _ in range(2))
        self.listed = listed

    def forward(self, x):
        for layer in self.layers:
            made = [-0.5, -0.4, -0.3, -0.2] if self.listed else -0.5
            x = torch.maximum(layer(x), torch.tensor(made, device=x.device))
        return x


def test_a_model_that_cannot_be_split_names_the_model_and_the_alternatives():
    call = ModelCall("", (torch.ones(2, 4),), {})
    with pytest.raises(PipelineConfigError, match=r"cannot trace and split Branchy.*split='prune'"):
        traced_placement(Branchy(), "layers", 2, None, call, True)
    with pytest.raises(PipelineConfigError, match=r"Made's forward creates tensors from values \(lifted_tensor_0"):
        traced_placement(Made(listed=True), "layers", 2, None, call, True)
    call = ModelCall("model", (), {"input_ids": torch.zeros(2, 8, dtype=torch.long), "use_cache": True})
    with pytest.raises(PipelineConfigError, match=r"calls GPT2LMHeadModel with use_cache=True.*use_cache=False"):
        traced_placement(HFGPT2Cache(), "model.transformer.h", 2, None, call, True)
    model = HFGPT2Cache()  # its default use_cache=True: the traced copy runs without the cache, the model keeps it
    traced_placement(
        model, "model.transformer.h", 2, None, call._replace(kwargs={"input_ids": call.kwargs["input_ids"]}), True
    )
    assert model.model.config.use_cache is True
    call = ModelCall("model", (), {"input_ids": torch.zeros(2, 8, dtype=torch.long)})
    with pytest.raises(PipelineConfigError, match=r"experts_implementation='eager'.*'grouped_mm'.*'batched_mm'"):
        traced_placement(HFMoEEager(), "model.model.layers", 2, None, call, True)


def chain(model: nn.Module, layers: str, n_stages: int, call: ModelCall):
    """The traced pieces of every stage, run one after another in this process as the pipeline runs them."""
    placement, tracer = traced_placement(model, layers, n_stages, None, call, model.training)
    views = {s: stage_view(model, placement, [s]) for s in range(n_stages)}
    stages = tracer.stages(views, torch.device("cpu"))(model.training, call)
    received: tuple = ()
    for stage in stages:
        stage.inputs, stage.mb_size = [call], 1
        received = stage(*received, mb=torch.zeros(1))
    return placement, stages[-1].outputs[0]


def test_a_nanogpt_shaped_model_traces_into_exact_pieces():
    # nanoGPT ties the head's weight to the embedding the other way round, and computes positions with arange
    torch.manual_seed(0)
    model = NanoGPT()
    tokens, targets = torch.randint(0, 32, (2, 8)), torch.randint(0, 32, (2, 8))
    placement, (logits, loss) = chain(model, "transformer.h", 3, ModelCall("", (tokens, targets), {}))
    eager_logits, eager_loss = model(tokens, targets)
    assert torch.equal(logits, eager_logits) and torch.equal(loss, eager_loss)
    loss.backward()
    traced = {n: p.grad.clone() for n, p in model.named_parameters()}
    model.zero_grad()
    eager_loss.backward()
    assert max((traced[n] - p.grad).abs().max().item() for n, p in model.named_parameters()) < 1e-6
    (tie,) = placement.ties
    assert tie.names == ("transformer.wte.weight", "lm_head.weight") and tie.stages == (0, 2)


def test_numbers_forward_makes_into_tensors_keep_their_values():
    # traced on meta, torch.tensor(-0.5, device=x.device) would be a meta constant: made on the CPU it keeps -0.5
    torch.manual_seed(0)
    model, x = Made(), torch.randn(2, 4)
    _, out = chain(model, "layers", 2, ModelCall("", (x,), {}))
    assert torch.equal(out, model(x))
    # HF GPT-Neo's attention masks with torch.tensor(finfo.min, device=...): its pieces equal the eager model
    config = GPTNeoConfig(
        vocab_size=32, hidden_size=32, num_layers=2, num_heads=4, attention_types=[[["global", "local"], 1]],
        max_position_embeddings=16, embed_dropout=0.0, resid_dropout=0.0, attention_dropout=0.0, use_cache=False,
    )  # fmt: skip
    neo, tokens = GPTNeoForCausalLM(config), torch.randint(0, 32, (2, 8))
    _, traced = chain(neo, "transformer.h", 2, ModelCall("", (), {"input_ids": tokens, "labels": tokens}))
    assert torch.equal(traced.loss, neo(input_ids=tokens, labels=tokens).loss)


def test_token_weighted_microbatches_train_as_one_process_on_padded_batches(tmp_path, reference):
    # labels -100 past a random length: micro-batches hold different numbers of real tokens. With
    # microbatch_weight (label tokens after the shift) the loss is the batch's token mean, as on one process
    cfg = dict(GPT2, pad=True, weighted=True, schedule="1f1b", devices=2, m=4, batch=8, n_train=32)
    job = ok(run_job({**cfg, "strategy": "pipeline"}, tmp_path / "weighted", timeout=240))
    ref = reference(**common(cfg))
    assert_same_logs(job.rank(0), ref, LOSS_TOL)
    assert_state_equal(job.state(), ref["state"], 1e-5)
    # without it: the mean of the micro-batches' means, visibly another loss
    plain = ok(run_job({**cfg, "weighted": False, "strategy": "pipeline"}, tmp_path / "plain", timeout=240))
    got, expected = plain.rank(0)["train"], ref["train"]
    assert max(abs(a["train_loss"] - b["train_loss"]) for a, b in zip(got, expected)) > 1e-2


def test_token_weights_span_the_replicas_and_the_accumulation_window(tmp_path, reference):
    # 2 replicas x 2 stages accumulating 2 batches: each optimizer step is the token mean over the 4 batches
    # of its window, which one process computes on one batch of all 32 samples (the replicas' order)
    cfg = dict(GPT2, pad=True, weighted=True, schedule="gpipe", devices=4, pp=2, m=2, batch=8, n_train=64,
               accumulate=2, max_epochs=2)  # fmt: skip
    job = ok(run_job({**cfg, "strategy": "pipeline"}, tmp_path / "job", timeout=300))
    ref = reference(**{**common(cfg), "batch": 32, "accumulate": 1, "replicas_order": True})
    assert len([r for r in ref["logged"] if "train_loss" in r]) == 4
    assert_state_equal(job.state(), ref["state"], 1e-5)
