"""Adapters built on meta start as peft starts them, ``init_weights`` finds the base under peft's names by itself,
and ``init_adapter`` starts the adapters from a PEFT adapter directory, each rank reading its own tensors."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch
from conftest import ok, run_job
from models import DoraLlama, HFLlama, LoraLlama, loader
from test_parity import assert_same_logs, common
from torch import nn

from lightning_pp import empty_weights, materialize, name_seed
from lightning_pp.checkpoints.adapter_weights import open_adapter
from lightning_pp.errors import PipelineConfigError
from lightning_pp.memory.materialize import check_initializers

LOSS_TOL, PARAM_TOL = 2e-4, 1e-5
LORA = dict(
    model="lora_llama", layers="model.base_model.model.model.layers", split="trace", schedule="1f1b", devices=2, m=2,
    optimizer="sgd", lr=0.5, batch=8, n_train=32, n_val=16, build="init_module",
)  # fmt: skip


@pytest.fixture(scope="module")
def saved(tmp_path_factory) -> dict[str, Path]:
    """A pretrained HF Llama (seed 123, several shards), adapter directories of LoraLlama and of DoraLlama whose
    adapters are random (lora_B too: a start peft's initialisation never gives), and one of another rank (r=8)."""
    from peft import LoraConfig, get_peft_model

    root = tmp_path_factory.mktemp("adapters")
    torch.manual_seed(123)
    HFLlama().model.save_pretrained(root / "llama", max_shard_size="40KB")
    lora = LoraLlama()
    with torch.no_grad():
        for name, p in lora.named_parameters():
            if ".lora_" in name:
                p.normal_(std=0.2)
    lora.model.save_pretrained(root / "adapter")
    dora = DoraLlama()
    with torch.no_grad():
        for name, p in dora.named_parameters():
            if ".lora_" in name:
                p.normal_(mean=1.0 if "magnitude" in name else 0.0, std=0.2)
    dora.model.save_pretrained(root / "dora")
    other = get_peft_model(HFLlama().model, LoraConfig(r=8, lora_alpha=8, target_modules=["q_proj", "v_proj"]))
    other.save_pretrained(root / "r8")
    return {"llama": root / "llama", "adapter": root / "adapter", "dora": root / "dora", "r8": root / "r8"}


def _meta(cls: type, **kwargs: object) -> nn.Module:
    with empty_weights():
        return cls(**kwargs)


def test_lora_llama_on_meta_starts_as_transformers_and_peft_start_it():
    """Each module under the name rule, by its library's initialiser: HF's _init_weights for the base (after the
    module's own reset_parameters, eager construction's order), each LoRA layer's reset_lora_parameters after its
    adapters' Linears (lora_B zero); an HF Llama on meta needs no init_fn (LlamaRMSNorm has no reset_parameters)."""
    model = materialize(_meta(LoraLlama))
    eager = LoraLlama()
    llama = eager.model.base_model.model
    lora_layers = {n: m for n, m in eager.named_modules() if hasattr(m, "reset_lora_parameters")}
    assert len(lora_layers) == 4
    with torch.no_grad():
        for name, module in eager.named_modules():
            if (
                ".lora_" not in name
                and module not in lora_layers.values()
                and next(module.parameters(recurse=False), None) is not None
            ):
                torch.manual_seed(name_seed(0, name))
                if hasattr(module, "reset_parameters"):
                    module.reset_parameters()
                llama._init_weights(module)
        for name, layer in lora_layers.items():
            torch.manual_seed(name_seed(0, name))
            layer.reset_lora_parameters("default", True)
    state, expected = model.state_dict(), eager.state_dict()
    lora_b = [k for k in state if ".lora_B." in k]
    assert len(lora_b) == 4 and all(torch.count_nonzero(state[k]) == 0 for k in lora_b)
    assert all(torch.equal(state[k], v) for k, v in expected.items() if ".lora_B." not in k)  # base and lora_A
    norm = state["model.base_model.model.model.norm.weight"]
    assert torch.equal(norm, torch.ones_like(norm))
    # one layer alone (an FSDP unit): the model around it (``within``) says whose rule applies, same values
    meta, layer = _meta(LoraLlama), "model.base_model.model.model.layers.3"
    unit = materialize(meta.get_submodule(layer), prefix=layer, within=meta)
    assert all(torch.equal(v, state[f"{layer}.{k}"]) for k, v in unit.state_dict().items())
    check_initializers(_meta(HFLlama))  # accepted without init_fn


def test_what_a_library_cannot_start_on_meta_is_named():
    from peft import LoraConfig, get_peft_model

    # an init drawn from the base otherwise (orthogonal): named at setup, init_adapter the fix; three modules shown
    # of 8 (lora_A and lora_B in each of 4 layers)
    model = _meta(HFLlama)
    model.model = get_peft_model(
        model.model, LoraConfig(r=4, target_modules=["q_proj"], init_lora_weights="orthogonal")
    )
    said = r"init_lora_weights=.orthogonal.; on meta: True, False or 'gaussian'\) and 5 more\."
    with pytest.raises(PipelineConfigError, match=rf"layers\.\d\.self_attn\.q_proj.*{said}.*init_adapter=DIR"):
        check_initializers(model)

    class Scale(nn.Module):  # a parameter HF's _init_weights does not know, and no reset_parameters
        def __init__(self) -> None:
            super().__init__()
            self.gain = nn.Parameter(torch.ones(4))

    model = _meta(HFLlama)
    with empty_weights():
        model.model.model.scale = Scale()
    check_initializers(model)  # inside an HF model: _init_weights is its initialiser, which leaves it unset
    with pytest.raises(
        PipelineConfigError, match=r"'model\.model\.scale' \(Scale: \['gain'\], by LlamaModel\._init_weights\)"
    ):
        materialize(model)


def test_dora_on_meta_starts_its_magnitudes_as_peft_does_from_the_base():
    """Each magnitude is peft's start (the norm of W + scaling B A per output) from the base materialised
    before it, under the name rule: one process calling materialize gets the same."""
    from peft.tuners.lora.dora import DoraLinearLayer

    model = _meta(DoraLlama)
    check_initializers(model)  # accepted without init_fn or init_adapter
    materialize(model)
    layers = [m for m in model.modules() if "default" in getattr(m, "lora_magnitude_vector", {})]
    assert len(layers) == 4
    for layer in layers:
        lora_weight = layer.lora_B["default"].weight @ layer.lora_A["default"].weight
        expected = DoraLinearLayer(False).get_weight_norm(
            layer.base_layer.weight, lora_weight, layer.scaling["default"]
        )
        assert torch.equal(layer.lora_magnitude_vector["default"].weight, expected)
        assert 0 < float(expected.min()) and not torch.equal(expected, torch.ones_like(expected))


@pytest.mark.parametrize(
    "model,tensors",
    [("lora_llama", "8 adapter tensors (lora_A, lora_B)"),
     ("dora_llama", "12 adapter tensors (lora_A, lora_B, lora_magnitude_vector)")],
)  # fmt: skip
def test_lora_llama_on_meta_reads_the_base_by_itself_and_starts_from_the_pretrained_loss(
    saved, tmp_path, reference, model, tensors
):
    # no init_weights_keys, no init_fn: the base under peft's names found in the HF directory, the adapters started
    # by peft's rule (DoRA's magnitudes from the base read, not the one materialised); the first loss is the
    # pretrained model's own, and the run is one process's
    from transformers import AutoModelForCausalLM

    cfg = dict(LORA, model=model, pretrained=str(saved["llama"]))
    job = ok(run_job({**cfg, "strategy": "pipeline"}, tmp_path / "job", timeout=240))
    assert job.output.count(f"{tensors} start from peft's initialisation") == 1, job.output[-3000:]
    ref = reference(**common(cfg))
    assert_same_logs(job.rank(0), ref, LOSS_TOL)
    _assert_trained_equal(job.state(), ref["state"])
    batch = next(iter(loader(cfg["n_train"], cfg["batch"])))
    with torch.no_grad():
        llama = AutoModelForCausalLM.from_pretrained(saved["llama"])
        loss = llama(input_ids=batch["tokens"], labels=batch["targets"]).loss.item()
    first = next(r["train_loss"] for r in job.rank(0)["logged"] if "train_loss" in r)
    assert abs(first - loss) <= LOSS_TOL, (first, loss)


@pytest.mark.parametrize("model,adapter,tensors", [("lora_llama", "adapter", 8), ("dora_llama", "dora", 12)])
def test_init_adapter_starts_each_rank_from_its_adapter_tensors(model, adapter, tensors, saved, tmp_path, reference):
    # on meta, base from init_weights, adapters from the adapter directory (their modules need no initialiser);
    # the one-process run loads the same directory with PeftModel.from_pretrained. DoRA's route on meta: peft's file
    # names its magnitudes "lora_magnitude_vector" (no ".weight"), which the directory was refused for
    cfg = dict(LORA, model=model, pretrained=str(saved["llama"]), init_adapter=str(saved[adapter]))
    job = ok(run_job({**cfg, "strategy": "pipeline"}, tmp_path / "job", timeout=240))
    said = f"init_adapter: {tensors} tensors of adapter 'default'"
    assert "start from init_adapter=" in job.output and said in job.output, job.output[-3000:]
    ref = reference(**common(cfg))
    assert_same_logs(job.rank(0), ref, LOSS_TOL)
    _assert_trained_equal(job.state(), ref["state"])
    assert torch.count_nonzero(
        ref["initial"]["model.base_model.model.model.layers.3.self_attn.v_proj.lora_B.default.weight"]
    )


def test_an_adapter_directory_of_another_configuration_is_refused(saved):
    with pytest.raises(PipelineConfigError, match=r"r=8 in adapter_config.json, 4 in the module"):
        open_adapter(saved["r8"], _meta(LoraLlama))
    with pytest.raises(PipelineConfigError, match=r"does not fit adapter 'default'.*layers\.4\.self_attn"):
        open_adapter(saved["adapter"], _meta(LoraLlama, n_layers=6))  # LoRA on layers 3-5, the file's on 2-3
    with pytest.raises(PipelineConfigError, match=r"not a PEFT adapter directory.*adapter_config\.json"):
        open_adapter(saved["llama"], _meta(LoraLlama))


def _assert_trained_equal(state: dict[str, torch.Tensor], ref: dict[str, torch.Tensor]) -> None:
    """The checkpoint's tensors (every adapter tensor among them; the frozen base may be left out) as one process's."""
    assert {k for k in ref if ".lora_" in k} <= state.keys() <= ref.keys()
    worst = max((state[k] - ref[k]).abs().max().item() for k in state)
    assert worst <= PARAM_TOL


def test_peft_adapters_of_a_kind_that_does_not_trace_are_named_with_the_fix():
    # LoHa's trace stopped on a guard only data decides ("Eq(u0, 1)"), and the fix said was the seed convention
    from peft import LoHaConfig, get_peft_model

    from lightning_pp.split.microbatch import ModelCall
    from lightning_pp.split.traced import Tracer

    module = HFLlama(n_layers=2)
    module.model = get_peft_model(module.model, LoHaConfig(r=4, alpha=8, target_modules=["q_proj"]))
    tokens = torch.zeros(2, 8, dtype=torch.long)
    call = ModelCall("model", (), {"input_ids": tokens, "labels": tokens})
    tracer = Tracer(module, "model", "model.base_model.model.model.layers", (1, 1))
    fix = r"Its peft adapters \(loha at base_model\.model\.model\.layers\.0\.self_attn\.q_proj\) are of a kind that"
    with pytest.raises(PipelineConfigError, match=fix + r" does not trace here: train LoRA \(or DoRA, AdaLoRA, IA3\)"):
        tracer.trace(True, call)
