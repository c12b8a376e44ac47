"""Trained adapters out both ways: ``consolidate --format peft`` loaded by ``PeftModel.from_pretrained`` on the base
the run started from, ``--format hf`` (LoRA merged) loaded by ``AutoModelForCausalLM.from_pretrained`` with no
missing or unexpected keys; both give the trained model's logits (a sharded checkpoint without its base: in
test_frozen_checkpoints.py). Exports that would lose trained tensors stop."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch
from conftest import consolidate_cli, ok, run_job
from models import HFLlama, LoraBert, LoraLlama, TinyGPT
from test_parity import common
from test_tied import assert_state_equal

from lightning_pp.checkpoints.adapter_weights import open_adapter
from lightning_pp.checkpoints.adapters import adapter_sites
from lightning_pp.checkpoints.export import EXPORT_KEY, export_hf, export_names, export_peft
from lightning_pp.checkpoints.frozen import FROZEN_KEY, fingerprint
from lightning_pp.errors import PipelineConfigError

LOGITS_TOL = 1e-4
LORA = dict(model="lora_llama", layers="model.base_model.model.model.layers", split="trace", schedule="1f1b",
            devices=2, m=2, batch=8, n_train=32, n_val=8, limit_val_batches=0, sanity=0, optimizer="adamw",
            lr=1e-2)  # fmt: skip
IDS = torch.randint(0, 32, (4, 16), generator=torch.Generator().manual_seed(7))


def logits_of_state(state: dict[str, torch.Tensor]) -> torch.Tensor:
    """The trained model: the checkpoint's state dict in a LoraLlama (peft's forward, adapters unmerged)."""
    model = LoraLlama()
    model.load_state_dict(state)
    with torch.no_grad():
        return model.model.eval()(input_ids=IDS).logits


def base_model(initial: dict[str, torch.Tensor]):
    """The base the run started from, as peft users hold it: the HF model with the initial frozen weights."""
    from transformers import LlamaForCausalLM

    site = adapter_sites(LoraLlama())[0]
    base = LlamaForCausalLM(LoraLlama().model.base_model.model.config)
    base.load_state_dict({site.base_key(k): v for k, v in initial.items() if site.base_key(k) is not None})
    return base


def assert_exports_reproduce(ckpt: Path, state: dict[str, torch.Tensor], initial: dict[str, torch.Tensor]) -> None:
    """``consolidate --format peft`` and ``--format hf`` of ``ckpt``, each loaded as its library loads it, give
    ``state``'s logits."""
    from peft import PeftModel

    want = logits_of_state(state)
    out = ckpt.parent / "exports"
    run = consolidate_cli(ckpt, out / "peft", "--format", "peft")
    assert run.returncode == 0, run.stderr[-3000:]
    assert sorted(p.name for p in (out / "peft").iterdir()) == ["adapter_config.json", "adapter_model.safetensors"]
    adapted = PeftModel.from_pretrained(base_model(initial), out / "peft")
    with torch.no_grad():
        assert (adapted(input_ids=IDS).logits - want).abs().max() <= LOGITS_TOL
        assert (base_model(initial)(input_ids=IDS).logits - want).abs().max() > 100 * LOGITS_TOL  # it trained
    run = consolidate_cli(ckpt, out / "hf", "--format", "hf", "--max-shard-size", "40KB")
    assert run.returncode == 0, run.stderr[-3000:]
    assert "left out" not in run.stdout and len(list((out / "hf").glob("*.safetensors"))) > 1
    assert_merged_reproduces(out / "hf", want)


def assert_merged_reproduces(merged_dir: Path, want: torch.Tensor) -> None:
    from transformers import AutoModelForCausalLM

    merged, info = AutoModelForCausalLM.from_pretrained(merged_dir, output_loading_info=True)
    assert not info["missing_keys"] and not info["unexpected_keys"] and not info["mismatched_keys"], info
    with torch.no_grad():
        assert (merged(input_ids=IDS).logits - want).abs().max() <= LOGITS_TOL


def test_a_lora_run_under_1f1b_exports_as_a_peft_adapter_and_as_the_merged_model(tmp_path):
    ok(run_job({**LORA, "strategy": "pipeline"}, tmp_path / "job", timeout=240))
    ckpt = tmp_path / "job" / "final.ckpt"
    checkpoint = torch.load(ckpt, weights_only=False)
    state, initial = checkpoint["state_dict"], torch.load(tmp_path / "job" / "initial.pt")
    # what trained is recorded for the whole module (both ranks' stages), not only the writer's
    trainable = checkpoint[EXPORT_KEY]["trainable"]
    assert trainable == sorted(n for n, p in LoraLlama().named_parameters() if p.requires_grad)
    assert all(state[n].abs().max() > 0 for n in trainable if "lora_B" in n)  # lora_B moved from its zeros
    assert_exports_reproduce(ckpt, state, initial)
    want = logits_of_state(state)

    # a checkpoint without its frozen base (every frozen tensor from init_weights): the merged export reads the
    # base from the recorded init_weights directory
    site = adapter_sites(LoraLlama())[0]
    base_model(initial).save_pretrained(tmp_path / "base")
    frozen = {n for n in state if site.adapter_of(n) is None}
    lean = {**checkpoint, "state_dict": {n: t for n, t in state.items() if n not in frozen}}
    lean[EXPORT_KEY] = {**checkpoint[EXPORT_KEY], "keys": {n: site.base_key(n) for n in frozen}}
    base = (tmp_path / "base").resolve()
    lean[FROZEN_KEY] = {"init_weights": str(base), "fingerprint": fingerprint(base), "left_out": sorted(frozen)}
    torch.save(lean, tmp_path / "lean.ckpt")
    export_hf(tmp_path / "lean.ckpt", tmp_path / "lean_hf")
    assert_merged_reproduces(tmp_path / "lean_hf", want)
    model_file = next(base.glob("*.safetensors"))
    model_file.write_bytes(model_file.read_bytes())  # the base rewritten since the run read it
    with pytest.raises(PipelineConfigError, match=r"files changed since: .*safetensors was rewritten"):
        export_hf(tmp_path / "lean.ckpt", tmp_path / "lean_hf_stale")

    # a run that also trained a tensor outside the adapter: the adapter alone would lose it, the merged model keeps
    # it; a trained tensor outside the HF model is lost either way
    embedding = "model.base_model.model.model.embed_tokens.weight"
    also = {**checkpoint, EXPORT_KEY: {**checkpoint[EXPORT_KEY]}}
    also[EXPORT_KEY]["trainable"] = [*checkpoint[EXPORT_KEY]["trainable"], embedding]
    torch.save(also, tmp_path / "also.ckpt")
    with pytest.raises(PipelineConfigError, match=rf"trained tensors would be lost: {embedding}; .*--format hf"):
        export_peft(tmp_path / "also.ckpt", tmp_path / "also_peft")
    assert not (tmp_path / "also_peft").exists()
    export_hf(tmp_path / "also.ckpt", tmp_path / "also_hf")
    also["state_dict"] = {**state, "head.weight": torch.zeros(2, 2)}
    also[EXPORT_KEY]["trainable"].append("head.weight")
    torch.save(also, tmp_path / "outside.ckpt")
    with pytest.raises(PipelineConfigError, match=r"trained tensors would be lost: head\.weight; "):
        export_hf(tmp_path / "outside.ckpt", tmp_path / "outside_hf")
    with pytest.raises(PipelineConfigError, match=r"no adapter named 'other'.*\['default'\].*--adapter"):
        export_peft(ckpt, tmp_path / "nothing", adapter="other")


@pytest.mark.parametrize("how", ["plain", "pipeline"])
def test_peft_export_of_a_run_without_adapters_is_refused(tmp_path, how):
    # a one-process TinyGPT checkpoint: plain Lightning's (nothing recorded), and one recording no adapters
    model = TinyGPT()
    checkpoint = {"state_dict": model.state_dict()}
    if how == "pipeline":
        checkpoint[EXPORT_KEY] = export_names(model, None)
    torch.save(checkpoint, tmp_path / "tiny.ckpt")
    run = consolidate_cli(tmp_path / "tiny.ckpt", tmp_path / "out", "--format", "peft")
    assert run.returncode != 0 and "records no peft adapters" in run.stderr and "--format hf" in run.stderr
    assert not (tmp_path / "out").exists()


def test_a_lora_classifier_trains_its_head_whole_and_exports_it_both_ways(tmp_path, reference):
    # task_type="SEQ_CLS": peft trains a copy of the classifier (modules_to_save) beside LoRA. Built on meta, the
    # copy started other than the classifier it copies (one process: equal); the merged export refused the
    # adapter and the adapter export lost the trained head. Defaults (layers found, traced), ZBV on 4 stages
    from peft import PeftModel
    from transformers import AutoModelForSequenceClassification, BertForSequenceClassification

    cfg = dict(model="lora_bert", layers=None, split=None, schedule="zbv", devices=2, m=4, batch=8, n_train=32,
               n_val=8, limit_val_batches=0, sanity=0, optimizer="sgd", lr=0.5, build="init_module")  # fmt: skip
    job = ok(run_job({**cfg, "strategy": "pipeline"}, tmp_path / "job", timeout=240))
    ref = reference(**common(cfg))
    head = "model.base_model.model.classifier"
    for part in ("weight", "bias"):  # the copy starts as the classifier, as get_peft_model's deep copy does
        assert torch.equal(
            ref["initial"][f"{head}.original_module.{part}"], ref["initial"][f"{head}.modules_to_save.default.{part}"]
        )
    state = job.state()
    assert_state_equal(state, ref["state"], 1e-5)
    moved = state[f"{head}.modules_to_save.default.weight"] - ref["initial"][f"{head}.modules_to_save.default.weight"]
    assert moved.abs().max() > 1e-3  # the head trained

    model = LoraBert()
    model.load_state_dict(state)
    site = adapter_sites(model)[0]
    tokens = IDS[:, :8]
    with torch.no_grad():
        want = model.model.eval()(input_ids=tokens).logits
    out = tmp_path / "exports"
    for fmt in ("peft", "hf"):
        run = consolidate_cli(tmp_path / "job" / "final.ckpt", out / fmt, "--format", fmt)
        assert run.returncode == 0, run.stderr[-3000:]
    base = BertForSequenceClassification(LoraBert().model.base_model.model.config)
    base.load_state_dict({site.base_key(k): v for k, v in ref["initial"].items() if not site.adapter_of(k)})
    with torch.no_grad():
        assert (base.eval()(input_ids=tokens).logits - want).abs().max() > 100 * LOGITS_TOL  # it trained
    adapted = PeftModel.from_pretrained(base, out / "peft")  # adapts base in place
    merged, info = AutoModelForSequenceClassification.from_pretrained(out / "hf", output_loading_info=True)
    assert not info["missing_keys"] and not info["unexpected_keys"], info
    with torch.no_grad():
        assert (adapted.eval()(input_ids=tokens).logits - want).abs().max() <= LOGITS_TOL
        assert (merged.eval()(input_ids=tokens).logits - want).abs().max() <= LOGITS_TOL
    model.model.save_pretrained(tmp_path / "saved")  # peft's own adapter directory starts the copy (init_adapter)
    _, weights = open_adapter(tmp_path / "saved", LoraBert())
    assert weights.keys[f"{head}.modules_to_save.default.weight"] == "base_model.model.classifier.weight"


@pytest.mark.parametrize(
    "lora",
    [
        dict(target_modules=["q_proj", "embed_tokens"], use_dora=True),
        dict(target_modules=["q_proj"], modules_to_save=["lm_head"]),
        dict(target_modules=[], target_parameters=["mlp.up_proj.weight"]),
    ],
    ids=["dora-embedding", "modules_to_save", "parameters"],
)
def test_adapter_names_are_peft_s_own_file_names(lora):
    # what --format peft writes and init_adapter reads: a LoRA embedding's lora_embedding_A.default and DoRA's
    # lora_magnitude_vector.default.weight were named otherwise than peft's file names them (peft could not load them)
    from peft import LoraConfig, get_peft_model, get_peft_model_state_dict

    module = HFLlama(n_layers=2)
    module.model = get_peft_model(module.model, LoraConfig(r=4, **lora))
    site = adapter_sites(module)[0]
    ours = {site.peft_key(n) for n, _ in module.named_parameters() if site.adapter_of(n) == "default"}
    embedding = "base_model.model.model.embed_tokens.base_layer.weight"  # peft's save_embedding_layers="auto" extra
    assert ours == set(get_peft_model_state_dict(module.model)) - {embedding}
