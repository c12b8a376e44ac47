"""Mixture-of-experts models from transformers at their defaults under ``split="trace"``, their load-balancing
loss, and experts sharded over a stage's replicas (``expert_parallel_size``), each against one process fed the same
micro-batches (a load-balancing loss does not add up over micro-batches: the reference computes it per
micro-batch, as the pipeline does)."""

from __future__ import annotations

import pytest
import torch
from conftest import consolidate_cli, ok, run_job
from models import MOE as MOE_MODELS
from models import HFLlama, LoraLlama4, LoraMoE, transformers_at_least
from test_frozen import _micro
from test_parity import common
from test_tied import assert_state_equal, combined

from lightning_pp.choose.costs import counted_costs
from lightning_pp.errors import PipelineConfigError
from lightning_pp.split.profiling import DeviceSpeed

LOSS_TOL, PARAM_TOL = 2e-4, 1e-5
MOE = dict(split="trace", layers="model.model.layers", n_layers=4, n_val=8)


def _losses(rows: list[dict], key: str = "train_loss") -> list[float]:
    return [r[key] for r in rows if key in r]


def _close(got: list[float], expected: list[float]) -> None:
    assert len(got) == len(expected) > 0 and max(abs(a - b) for a, b in zip(got, expected)) <= LOSS_TOL, (got, expected)


@pytest.mark.parametrize(
    "family,schedule",
    [
        ("mixtral", "1f1b"),
        ("qwen3_moe", "zbv"),
        ("olmoe", "interleaved_1f1b"),
        ("gpt_oss", "1f1b"),
        ("deepseek_v3", "1f1b"),
    ],  # fmt: skip
)
def test_hf_moe_models_at_their_defaults_train_as_one_process(family, schedule, tmp_path, reference):
    # transformers picks the grouped_mm experts, whose token count branches on the device: the trace on meta
    # records the accelerator's integer histogram, which the CPU cannot count
    cfg = dict(MOE, model=family, schedule=schedule, devices=2, m=4, batch=8, n_train=24)
    job = ok(run_job({**cfg, "strategy": "pipeline"}, tmp_path / "job", timeout=300))
    assert_state_equal(job.state(), reference(**_micro(cfg))["state"], PARAM_TOL)
    _close(_losses(job.rank(0)["logged"]), _losses(reference(**common(cfg))["logged"]))


TRACED_WITHOUT_DATA = transformers_at_least(5, 23)  # a router loss, float32 experts' backward


@pytest.mark.skipif(not TRACED_WITHOUT_DATA, reason="transformers < 5.23: the router loss's bincount, refused")
@pytest.mark.parametrize("model,pad", [("router", False), ("router_mask", True)], ids=["no-mask", "mask"])
def test_router_loss_is_per_microbatch_and_its_statistics_reach_every_rank(model, pad, tmp_path, reference):
    # Qwen2-MoE (shared experts), output_router_logits=True, the step adding 0.1 x aux_loss; with padded
    # sequences and their attention mask, or with no mask (the histogram branch)
    cfg = dict(MOE, model=model, schedule="1f1b", devices=2, m=2, batch=8, n_train=24, pad=pad)
    job = ok(run_job({**cfg, "strategy": "pipeline"}, tmp_path / "job", timeout=300))
    micro = reference(**_micro(cfg))
    assert_state_equal(job.state(), micro["state"], PARAM_TOL)
    for key in ("train_loss", "train_aux", "train_expert0"):
        per_micro = _losses(micro["train"], key)  # the pipeline's step logs the mean over its micro-batches
        means = [sum(per_micro[i : i + 2]) / 2 for i in range(0, len(per_micro), 2)]
        _close(_losses(job.rank(0)["train"], key), means)
        assert _losses(job.rank(1)["train"], key) == _losses(job.rank(0)["train"], key)  # every rank saw them
    assert job.output.count("its load-balancing loss is computed per micro-batch, so the pipeline trains") == 1
    whole = _losses(reference(**common(cfg))["logged"])  # the loss of whole batches differs: not additive
    assert max(abs(a - b) for a, b in zip(_losses(job.rank(0)["logged"]), whole)) > LOSS_TOL


@pytest.mark.skipif(TRACED_WITHOUT_DATA, reason="transformers >= 5.23 traces the load-balancing loss (the test above)")
def test_a_load_balancing_loss_transformers_cannot_trace_is_refused_naming_the_release(tmp_path):
    # transformers 5.17-5.22 count each expert's tokens with torch.bincount: no meta kernel, so no trace
    cfg = dict(MOE, model="router", schedule="1f1b", devices=2, m=2, batch=8, n_train=24)
    job = run_job({**cfg, "strategy": "pipeline"}, tmp_path / "job", timeout=120)
    assert job.returncode != 0
    assert "counts each expert's tokens with torch.bincount" in job.output, job.output[-3000:]
    assert "install transformers>=5.23" in job.output and "output_router_logits=False" in job.output


def test_experts_sharded_over_replicas_train_as_one_process_and_checkpoint_in_its_layout(tmp_path, reference):
    # 2 replicas x 2 ranks, 2 stages each (ZBV: the split backward), each rank holding 2 of every layer's 4
    # experts, built on meta and read from a saved Mixtral (each rank its own experts); SGD, so that the
    # all-to-all's other summation order (1e-9 here) is not magnified by Adam
    torch.manual_seed(0)  # the saved weights, whatever ran before
    MOE_MODELS["mixtral"](n_layers=4).model.save_pretrained(tmp_path / "mixtral", max_shard_size="60KB")
    cfg = dict(MOE, model="mixtral", schedule="zbv", devices=4, pp=2, ep=2, m=4, batch=8, n_train=32,
               optimizer="sgd", lr=0.05, state_dict_type="sharded", build="init_module",
               pretrained=str(tmp_path / "mixtral"))  # fmt: skip
    job = ok(run_job({**cfg, "strategy": "pipeline"}, tmp_path / "job", timeout=400))
    ref = reference(**combined(cfg))
    for rank in range(4):
        local, whole = job.rank(rank)["expert_bytes"]
        assert local * 2 == whole > 0, (rank, local, whole)
    seen = [_losses(job.rank(rank)["logged"]) for rank in (0, 2)]
    _close([sum(pair) / 2 for pair in zip(*seen)], _losses(ref["logged"]))

    # the sharded directory written under expert parallelism holds the one-process tensors
    full = tmp_path / "full.ckpt"
    proc = consolidate_cli(job.out / "final.ckpt", full)
    assert proc.returncode == 0, proc.stderr
    assert_state_equal(torch.load(full, weights_only=False)["state_dict"], ref["state"], PARAM_TOL)

    # and resumes under another layout: one pipeline of 2 ranks, no expert parallelism, 1F1B
    more = dict(cfg, devices=2, ep=1, schedule="1f1b", m=2, batch=16, max_epochs=2, replicas_order=True)
    other = ok(run_job({**more, "strategy": "pipeline", "resume": str(job.out / "final.ckpt")}, tmp_path / "other"))
    one = reference(**{**common(more), "state_dict_type": "full", "resume": str(full)})
    _close(_losses(other.rank(0)["logged"])[-2:], _losses(one["logged"])[-2:])


def test_lora_on_a_moe_models_attention_and_experts_read_from_its_hub_layout_exports_both_ways_without_its_base(
    tmp_path, reference
):
    # Qwen3-MoE saved as the Hub holds it (one tensor per expert), built on meta and read by init_weights, LoRA on
    # the attention and on the experts' stacked weights (peft's target_parameters: its ParamWrapper, which no trace
    # on meta recorded, "unsupported scalarType", runs eagerly inside each rank's traced pieces) under ZBV; the
    # checkpoint leaves the frozen base (experts included) out, and the merged export reads it back through
    # transformers' conversion. SGD: Qwen3's per-head q_norm leaves q_proj's adapter gradients near zero along some
    # directions, where AdamW turns rounding (1e-9) into steps (1e-5, 1 seed in 12)
    from peft import LoraConfig, PeftModel, get_peft_model
    from transformers import AutoModelForCausalLM

    torch.manual_seed(0)  # the saved weights, whatever ran before
    MOE_MODELS["qwen3_moe"](n_layers=4).model.save_pretrained(tmp_path / "qwen3_moe", max_shard_size="60KB")
    cfg = dict(MOE, model="lora_moe", layers="model.base_model.model.model.layers", schedule="zbv", devices=2, m=4,
               batch=8, n_train=16, build="init_module", pretrained=str(tmp_path / "qwen3_moe"), optimizer="sgd",
               lr=1.0)  # fmt: skip
    job = ok(run_job({**cfg, "strategy": "pipeline"}, tmp_path / "job", timeout=300))
    ref = reference(**_micro(cfg))
    saved = job.state()
    assert saved and all(".lora_" in k for k in saved)  # the base left out
    experts = [k for k in saved if ".mlp.experts." in k and ".lora_B." in k]
    # both stacks of each layer trained, well past the tolerance
    assert len(experts) == 8 and all(saved[k].abs().max() > 20 * PARAM_TOL for k in experts), experts
    assert_state_equal(saved, {k: v for k, v in ref["state"].items() if k in saved}, PARAM_TOL)
    ckpt = job.out / "final.ckpt"
    for form in ("hf", "peft"):
        proc = consolidate_cli(ckpt, tmp_path / form, "--format", form)
        assert proc.returncode == 0, proc.stderr[-3000:]
    merged, info = AutoModelForCausalLM.from_pretrained(tmp_path / "hf", output_loading_info=True)
    assert not info["missing_keys"] and not info["unexpected_keys"] and not info["mismatched_keys"], info
    one = get_peft_model(AutoModelForCausalLM.from_pretrained(tmp_path / "qwen3_moe"), LoraConfig(**LoraMoE.LORA))
    one.load_state_dict({k[len("model.") :]: v for k, v in saved.items()}, strict=False)
    adapted = PeftModel.from_pretrained(AutoModelForCausalLM.from_pretrained(tmp_path / "qwen3_moe"), tmp_path / "peft")
    tokens = torch.randint(0, 32, (2, 8))
    with torch.no_grad():
        assert (adapted(input_ids=tokens).logits - one(input_ids=tokens).logits).abs().max() < 1e-5
    assert_state_equal(merged.state_dict(), one.merge_and_unload().state_dict(), 1e-6)


def test_lora_on_llama4s_experts_and_a_linears_weight_by_name_trains_as_one_process_under_zero_bubble(
    tmp_path, reference
):
    # peft's documented target_parameters (Llama 4's feed_forward.experts.gate_up_proj) on experts that are not
    # transformers' experts kind, and a Linear's weight by name: each wrapper traces as its fold (the trace on meta
    # refused "unsupported scalarType", peft's autocast of the meta device), built on meta and read by init_weights
    torch.manual_seed(0)
    MOE_MODELS["llama4_text"](n_layers=4).model.save_pretrained(tmp_path / "llama4", max_shard_size="60KB")
    cfg = dict(MOE, model="lora_llama4", layers="model.base_model.model.model.layers", schedule="interleaved_zb",
               devices=2, m=4, batch=8, n_train=16, build="init_module", pretrained=str(tmp_path / "llama4"),
               optimizer="sgd", lr=1.0)  # fmt: skip
    job = ok(run_job({**cfg, "strategy": "pipeline"}, tmp_path / "job", timeout=300))
    saved = job.state()
    assert saved and all(".lora_" in k for k in saved)  # the base left out
    trained = [k for k in saved if (".experts." in k or ".shared_expert." in k) and ".lora_B." in k]
    assert len(trained) == 12 and all(saved[k].abs().max() > 20 * PARAM_TOL for k in trained), trained
    ref = reference(**_micro(cfg))
    assert_state_equal(saved, {k: v for k, v in ref["state"].items() if k in saved}, PARAM_TOL)


@pytest.mark.parametrize("family", ["qwen3_moe", "gpt_oss", "llama4_text", "llama"])
def test_lora_on_stacked_experts_merges_as_peft_merges_it(family):
    # peft's ParamWrapper cuts each expert's A and B from two matrices of rank x experts; Qwen3-MoE keeps its stacks
    # (experts, out, in), gpt-oss (experts, in, out); on a matrix (a Llama's q_proj.weight) it is plain LoRA. The
    # names do not say which parameter each nested wrapper adapts: the checkpoint records it
    from peft import LoraConfig, get_peft_model

    from lightning_pp.checkpoints.adapters import parameter_wrappers
    from lightning_pp.checkpoints.export_peft import lora_merges, record_adapters, recorded_sites

    torch.manual_seed(0)
    if family == "llama":
        module = HFLlama(n_layers=2)
        lora = LoraConfig(r=4, target_modules=[], target_parameters=["q_proj.weight", "mlp.up_proj.weight"])
        module.model = get_peft_model(module.model, lora)
    elif family == "llama4_text":
        module = LoraLlama4(n_layers=2)
    else:
        module = type("Lora", (LoraMoE,), {"family": family})(n_layers=2)
    with torch.no_grad():
        for name, p in module.named_parameters():
            if ".lora_" in name:
                p.normal_()
    state = {k: v.clone() for k, v in module.state_dict().items()}  # peft merges into the module's own
    export = {"adapters": record_adapters(module), "wrapped": parameter_wrappers(module)}
    site = recorded_sites(export)[0]
    merges = lora_merges(state, site, "default", export["wrapped"])
    stacks = [m for m in merges.values() if m.experts == 4]  # two in each of 2 layers; the rest matrices
    expected = {"llama": (4, 0), "llama4_text": (10, 4)}.get(family, (8, 4))  # Llama 4: a shared up_proj each too
    assert (len(merges), len(stacks)) == expected, merges
    want = module.model.merge_and_unload().state_dict()
    got = {site.base_key(n): merges[n].apply(state) if n in merges else t for n, t in state.items() if site.base_key(n)}
    assert_state_equal(got, want, 1e-5)


def test_balance_profile_counts_experts_adapted_by_lora():
    # balance="profile" counts a traced model's FLOPs on meta through the op the trace records for LoRA-adapted
    # experts: it could not run backward there ("no autograd formula"), and counted the experts nothing
    from lightning_pp.split.microbatch import ModelCall
    from lightning_pp.split.traced import Tracer

    tokens = torch.zeros(2, 8, dtype=torch.long)
    call = ModelCall("model", (), {"input_ids": tokens, "labels": tokens})
    if not TRACED_WITHOUT_DATA:  # transformers < 5.23: the experts' backward reads token counts, refused naming 5.23
        with pytest.raises(PipelineConfigError, match=r"cannot be costed on meta .* install transformers>=5\.23"):
            Tracer(MOE_MODELS["qwen3_moe"](n_layers=4), "model", "model.model.layers", (2, 2)).flop_costs(True, call)
        return
    costs = [
        Tracer(model, "model", f"model.{layers}", (2, 2)).flop_costs(True, call).layers
        for model, layers in ((LoraMoE(n_layers=4), "base_model.model.model.layers"),
                              (MOE_MODELS["qwen3_moe"](n_layers=4), "model.layers"))
    ]  # fmt: skip
    # its base frozen: no weight gradients there (without the experts, 0.45 of the plain model's layer)
    assert all(0.7 < a / b <= 1.2 for a, b in zip(*costs)), costs


def test_experts_split_over_replicas_refuse_lora_on_their_weights():
    # peft adds the whole stack's product to the weight: a rank holding part of the stack cannot take it
    from lightning_pp.errors import PipelineConfigError
    from lightning_pp.split.experts import route_experts

    with pytest.raises(PipelineConfigError, match=r"expert_parallel_size=2 with LoRA on the experts' own weights"):
        route_experts(LoraMoE(n_layers=2), 2)


def test_the_experts_flops_of_a_moe_model_built_on_meta_are_counted():
    # schedule="auto" (and balance="profile" on meta) costs such a model by its FLOPs: the experts' grouped_mm,
    # transformers' default, counts as batched_mm's matmuls of the same tokens and experts, which torch's counter
    # knows; before, the experts counted nothing (a Qwen3-MoE layer: half its forward) and in float32 the count
    # stopped (torch's grouped_mm without data takes bf16 only)
    batch = {"tokens": torch.zeros(8, 8, dtype=torch.long), "targets": torch.zeros(8, 8, dtype=torch.long)}
    counted = []
    for experts in (None, "batched_mm"):
        with torch.device("meta"):
            model = type("Qwen3MoE", (MOE_MODELS["qwen3_moe"],), {"experts": experts})(n_layers=2)
        assert model.model.config._experts_implementation == (experts or "grouped_mm")
        flops_alone = DeviceSpeed(1e12, 0.0)  # the two implementations dispatch other operations
        counted.append(counted_costs(model, batch, None, [8], flops_alone, torch.device("cpu")).measured[0])
    assert counted[0].forward == counted[1].forward and counted[0].backward == counted[1].backward, counted


@pytest.mark.parametrize("op", ["torch", "transformers_fallback"])
def test_grouped_matmuls_count_as_the_matmuls_of_each_expert(op):
    # torch's _grouped_mm and transformers' fallback custom op (what a trace of a float32 MoE model calls: the
    # counter cannot see into it), forward and backward, against the same arithmetic as one mm per expert
    import transformers.integrations.moe  # noqa: F401  (registers the fallback's ops)

    from lightning_pp.split.profiling import _flop_counter

    torch.manual_seed(0)
    x, w = torch.randn(12, 8, requires_grad=True), torch.randn(3, 8, 4, requires_grad=True)
    offs = torch.tensor([4, 4, 12], dtype=torch.int32)  # expert 1 gets no token
    grouped = torch._grouped_mm if op == "torch" else torch.ops.transformers.grouped_mm_fallback
    counts = []
    for run in (lambda: grouped(x, w, offs=offs), lambda: torch.cat([x[:4] @ w[0], x[4:] @ w[2]])):
        with _flop_counter() as counter:
            run().square().sum().backward()  # a contiguous gradient: the CPU kernel takes no expanded one
        counts.append(counter.get_total_flops())
    assert counts[0] == counts[1] == 3 * 2 * 12 * 8 * 4, counts
