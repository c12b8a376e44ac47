"""``init_weights``: each rank reads its own tensors of a pretrained checkpoint, and trains as one process that
called ``from_pretrained`` (or loaded the same state dict) on the same batches."""

from __future__ import annotations

import re
from pathlib import Path

import pytest
import torch
from conftest import consolidate_cli, ok, run_job
from models import HFGPT2, MOE, HFBertClassifier, HFLlama, LoraBert, TinyGPT, _moe_config, renamed_key
from test_frozen import _micro
from test_moe import _close, _losses
from test_parity import assert_same_logs, common
from test_tied import assert_state_equal, combined
from torch import nn

from lightning_pp import empty_weights, materialize
from lightning_pp.checkpoints import pretrained as pretrained_module
from lightning_pp.checkpoints.formats import load_sharded
from lightning_pp.checkpoints.pretrained import load_weights, match_weights, open_pretrained, read_keys
from lightning_pp.errors import PipelineConfigError

LOSS_TOL, PARAM_TOL = 2e-4, 1e-5
HF = dict(split="trace", optimizer="sgd", lr=0.5, n_val=16, batch=8, n_train=32, m=2)
LLAMA = dict(HF, model="llama", layers="model.model.layers")
GPT2 = dict(HF, model="gpt2", layers="model.transformer.h")


@pytest.fixture(scope="module")
def saved(tmp_path_factory) -> dict[str, Path]:
    """Pretrained checkpoints written here (no download), from weights no run starts from by itself (seed 123)."""
    root = tmp_path_factory.mktemp("pretrained")
    torch.manual_seed(123)
    HFLlama().model.save_pretrained(root / "llama", max_shard_size="40KB")  # several shards and an index
    HFGPT2().model.save_pretrained(root / "gpt2")  # tied: lm_head.weight is not saved
    tiny = TinyGPT(optimizer="sgd").state_dict()
    torch.save(tiny, root / "tiny.pt")
    torch.save({"model": {renamed_key(k): v for k, v in tiny.items()}}, root / "renamed.pt")
    for family in ("mixtral", "qwen3_moe"):  # one tensor per expert, as save_pretrained and the Hub hold them
        MOE[family](n_layers=4).model.save_pretrained(root / family, max_shard_size="60KB")
    paths = {"root": root, "llama": root / "llama", "gpt2": root / "gpt2", "tiny": root / "tiny.pt"}
    return {**paths, "mixtral": root / "mixtral", "qwen3_moe": root / "qwen3_moe"}


def _compare(job_cfg: dict, ref_cfg: dict, tmp_path: Path, reference, export: bool = False) -> None:
    """The pipelined run against one process; with ``export``, its checkpoint through ``consolidate --format hf``
    and back through ``from_pretrained``."""
    job = ok(run_job({**job_cfg, "strategy": "pipeline"}, tmp_path / "job", timeout=240))
    ref = reference(**ref_cfg)
    assert_same_logs(job.rank(0), ref, LOSS_TOL)
    assert "tensors from" in job.output and "read" in job.output  # the match said once, the bytes rank 0 read
    if job_cfg.get("state_dict_type") != "sharded":
        assert_state_equal(job.state(), ref["state"], PARAM_TOL)
    if export:
        from transformers import AutoModelForCausalLM

        out = tmp_path / "hf"
        run = consolidate_cli(tmp_path / "job" / "final.ckpt", out, "--format", "hf", "--max-shard-size", "60KB")
        assert run.returncode == 0, run.stderr[-3000:]
        assert len(list(out.glob("*.safetensors"))) > 1 and (out / "config.json").is_file()
        trained = AutoModelForCausalLM.from_pretrained(out).state_dict()
        assert_state_equal({f"model.{k}": v for k, v in trained.items()}, ref["state"], PARAM_TOL)


def test_hf_llama_on_meta_reads_its_sharded_safetensors_under_1f1b_and_exports_to_hf(saved, tmp_path, reference):
    assert len(list(saved["llama"].glob("*.safetensors"))) > 2
    cfg = dict(LLAMA, schedule="1f1b", devices=2, build="init_module", pretrained=str(saved["llama"]))
    _compare(dict(cfg, state_dict_type="sharded"), common(cfg), tmp_path, reference, export=True)
    # the sharded checkpoint just written (a DCP directory, weights beside optimizer state) as init_weights
    pretrained = open_pretrained(tmp_path / "job" / "final.ckpt")
    with empty_weights():
        model = HFLlama()
    assert pretrained.format == "dcp" and set(pretrained.shapes) == set(model.state_dict())  # no optimizer state
    weights = match_weights(pretrained, model)
    assert weights.prefix == ""  # the checkpoint's names are the module's
    materialize(model, loaded=frozenset(weights.keys))
    assert load_weights(pretrained, weights, model) == sum(t.numel() * 4 for t in model.state_dict().values())
    assert_state_equal(model.state_dict(), load_sharded(tmp_path / "job" / "final.ckpt")["state_dict"], 0.0)


def test_an_eager_hf_llama_has_its_random_weights_replaced_under_gpipe(saved, tmp_path, reference):
    cfg = dict(LLAMA, schedule="gpipe", devices=2, pretrained=str(saved["llama"]))
    _compare(cfg, common(cfg), tmp_path, reference)


def test_tied_hf_gpt2_on_meta_under_zbv(saved, tmp_path, reference):
    # one key (transformer.wte.weight) serves the embedding on stage 0 and the head on stage 3, both on rank 0;
    # GPT-2's Conv1D has no initialiser: on meta it needs the checkpoint for all of its tensors
    cfg = dict(GPT2, schedule="zbv", devices=2, m=4, build="init_module", pretrained=str(saved["gpt2"]))
    _compare(cfg, common(cfg), tmp_path, reference, export=True)  # from the full .ckpt


def test_fsdp_replicas_of_a_traced_hf_llama_read_their_slices(saved, tmp_path, reference):
    # split="trace" with data_parallel="fsdp": 2 replicas x 2 stages, each stage's FSDP root gathering its
    # units for the traced piece; each rank reads its shard of its stage's tensors from the safetensors
    cfg = dict(LLAMA, schedule="1f1b", devices=4, pp=2, data_parallel="fsdp", n_train=64, build="init_module",
               pretrained=str(saved["llama"]))  # fmt: skip
    job = ok(run_job({**cfg, "strategy": "pipeline"}, tmp_path / "job", timeout=300))
    ref = reference(**combined(cfg))
    # each replica logs its own loss (HF's step logs without sync_dist): their mean is the combined batch's
    replicas = list(zip(job.rank(0)["train"], job.rank(2)["train"], ref["train"], strict=True))
    assert len(replicas) == 4
    assert max(abs((a["train_loss"] + b["train_loss"]) / 2 - c["train_loss"]) for a, b, c in replicas) <= LOSS_TOL
    assert_state_equal(job.state(), ref["state"], PARAM_TOL)
    assert all(job.rank(r)["local_param_bytes"] * 2 == job.rank(r)["param_bytes"] for r in range(4))  # sharded


def test_fsdp_replicas_of_a_seed_convention_module_read_their_slices_of_a_renamed_torch_file(
    saved, tmp_path, reference
):
    # 2 replicas (FSDP) x 2 stages: each rank copies its shard of each of its stage's tensors out of a
    # {"model": ...} file in other names, mapped by init_weights_keys; Net's position table has no initialiser,
    # which the checkpoint makes unnecessary on meta
    cfg = dict(optimizer="sgd", lr=0.05, schedule="1f1b", m=2, devices=4, pp=2, data_parallel="fsdp", batch=8,
               n_train=64, n_val=16, sync_dist=True)  # fmt: skip
    job_cfg = dict(
        cfg, build="init_module", init_weights=str(saved["root"] / "renamed.pt"), init_weights_keys="renamed"
    )
    _compare(job_cfg, dict(combined(cfg), reference_state=str(saved["tiny"])), tmp_path, reference)


def test_names_that_do_not_match_are_refused_with_what_is_missing(saved):
    def meta(cls, **kwargs):
        with empty_weights():
            return cls(**kwargs)

    llama = open_pretrained(saved["llama"])
    weights = match_weights(llama, meta(HFLlama))
    assert weights.prefix == "-model." and len(weights.keys) == len(llama.shapes)
    with pytest.raises(PipelineConfigError, match=r"holds \d+ tensors that no tensor of HFLlama takes.*layers\.3"):
        match_weights(llama, meta(HFLlama, n_layers=3))  # a checkpoint of a deeper model
    with pytest.raises(
        PipelineConfigError, match=r"does not hold \d+ of HFLlama's parameters: model\.model\.layers\.4"
    ):
        match_weights(llama, meta(HFLlama, n_layers=5))
    renamed = open_pretrained(saved["root"] / "renamed.pt")
    with pytest.raises(PipelineConfigError, match=r"does not hold \d+ of TinyGPT's parameters.*init_weights_keys"):
        match_weights(renamed, meta(TinyGPT))
    with pytest.raises(PipelineConfigError, match=r"the keys init_weights_keys gave: net\.pos -> 'nowhere'"):
        match_weights(renamed, meta(TinyGPT), lambda n: "nowhere" if n == "net.pos" else renamed_key(n))
    left = match_weights(open_pretrained(saved["tiny"]), meta(TinyGPT), lambda n: None)
    assert left.keys and not left.left  # every name matched as it is: the map is asked for none
    partial = {k: v for k, v in torch.load(saved["tiny"]).items() if k != "net.pos"}
    torch.save(partial, saved["root"] / "partial.pt")
    weights = match_weights(open_pretrained(saved["root"] / "partial.pt"), meta(TinyGPT), lambda n: None)
    assert weights.left == {"net.pos"}
    with pytest.raises(PipelineConfigError, match=r"shapes differ.*\[32, 32\] in the checkpoint, \[32, 16\]"):
        match_weights(open_pretrained(saved["tiny"]), meta(TinyGPT, dim=16))
    with pytest.raises(PipelineConfigError, match=r"init_weights='.*nothing' is not a checkpoint.*Nothing exists"):
        open_pretrained(saved["root"] / "nothing")


def test_a_checkpoint_that_does_not_fit_stops_every_rank_before_training(saved, tmp_path):
    cfg = dict(LLAMA, n_layers=3, schedule="1f1b", devices=2, build="init_module", pretrained=str(saved["llama"]))
    job = run_job({**cfg, "strategy": "pipeline", "timeout": 30}, tmp_path / "job", timeout=120)
    assert job.returncode != 0 and job.seconds < 90, job.output[-3000:]
    assert job.output.count("that no tensor of HFLlama takes") >= 2, job.output[-3000:]  # on both ranks


def test_names_match_under_a_prefix_of_any_depth(saved):
    # the module holds the network three attributes deep; the checkpoint names it from the network down
    outer = nn.Module()
    outer.encoder = nn.Module()
    outer.encoder.backbone = TinyGPT(optimizer="sgd")
    weights = match_weights(open_pretrained(saved["tiny"]), outer)
    assert weights.prefix == "-encoder.backbone." and len(weights.keys) == len(outer.state_dict())


@pytest.mark.parametrize(
    "family,wrong,shapes",
    [("mixtral", dict(intermediate_size=16), ("[4, 64, 32]", "w1", "[4, 32, 32]")),
     ("qwen3_moe", dict(moe_intermediate_size=8), ("[4, 32, 32]", "gate_proj", "[4, 16, 32]"))],
)  # fmt: skip
def test_per_expert_checkpoints_are_fused_as_transformers_loads_them(saved, family, wrong, shapes, monkeypatch):
    # the checkpoint holds experts.0.gate_proj.weight ... (Mixtral: block_sparse_moe.experts.0.w1.weight), the
    # module the fused experts.gate_up_proj [E, 2I, H] and experts.down_proj [E, H, I]: matched through
    # transformers' own conversion list, on meta, and built by its operations
    path = saved[family]
    assert len(list(path.glob("*.safetensors"))) > 2
    with empty_weights():
        model = MOE[family](n_layers=4)
    pretrained = open_pretrained(path, model)
    fused = [k for k in pretrained.converted if k.endswith(("experts.gate_up_proj", "experts.down_proj"))]
    assert len(fused) == 8 and not any(".experts.0." in k for k in pretrained.shapes)
    weights = match_weights(pretrained, model)
    assert set(weights.keys) == set(model.state_dict()) and not weights.left  # every tensor from the checkpoint
    materialize(model, loaded=frozenset(weights.keys))
    assert load_weights(pretrained, weights, model) == sum(t.numel() * 4 for t in model.state_dict().values())
    from transformers import AutoModelForCausalLM

    expected = AutoModelForCausalLM.from_pretrained(path).state_dict()
    state = model.state_dict()
    assert set(state) == {f"model.{k}" for k in expected}
    assert all(torch.equal(state[f"model.{k}"], v) for k, v in expected.items())
    # one fused tensor is built from its own layer's experts, and nothing else is read
    read, plain = [], pretrained_module._read_plain
    monkeypatch.setattr(pretrained_module, "_read_plain", lambda p, wanted: (read.extend(wanted), plain(p, wanted)))
    target = "model.layers.1.mlp.experts.gate_up_proj"
    one = torch.empty(pretrained.shapes[target][0])
    read_keys(pretrained, {target: one})
    assert torch.equal(one, expected[target])
    assert sorted(read) == sorted(pretrained.converted[target].keys) and len(read) == 8
    assert all(".layers.1." in k and ".experts." in k for k in read)
    # a model of another configuration: refused at the fused tensor's shape, its sources named
    other = nn.Module()
    with empty_weights():
        other.model = AutoModelForCausalLM.from_config(_moe_config(family, 4, **wrong))
    checkpoint, source, module = (re.escape(s) for s in shapes)
    with pytest.raises(
        PipelineConfigError,
        match=rf"shapes differ.*experts\.gate_up_proj {checkpoint} in the checkpoint \(built by transformers'"
        rf" conversion from model\.layers\.\d\.\w+\.experts\.0\.{source}\.weight and 7 more\), {module} in the module",
    ):
        match_weights(open_pretrained(path, other), other)


def test_hf_qwen3_moe_on_meta_reads_its_per_expert_checkpoint_under_1f1b_and_exports_to_hf(saved, tmp_path, reference):
    # each rank builds only its own layers' fused experts, from only those layers' per-expert tensors
    cfg = dict(model="qwen3_moe", split="trace", layers="model.model.layers", n_layers=4, n_val=8, schedule="1f1b",
               devices=2, m=2, batch=8, n_train=16, build="init_module",
               pretrained=str(saved["qwen3_moe"]))  # fmt: skip
    job = ok(run_job({**cfg, "strategy": "pipeline"}, tmp_path / "job", timeout=300))
    assert "8 built or renamed from 48 checkpoint tensors" in job.output
    assert_state_equal(job.state(), reference(**_micro(cfg))["state"], PARAM_TOL)
    ref = reference(**common(cfg))["logged"]
    for key in ("train_loss", "val_loss"):
        _close(_losses(job.rank(0)["logged"], key), _losses(ref, key))
    # exported in the model's own (fused) layout, which from_pretrained loads as it is
    from transformers import AutoModelForCausalLM

    out = tmp_path / "hf"
    run = consolidate_cli(tmp_path / "job" / "final.ckpt", out, "--format", "hf", "--max-shard-size", "60KB")
    assert run.returncode == 0, run.stderr[-3000:]
    exported, info = AutoModelForCausalLM.from_pretrained(out, output_loading_info=True)
    assert not info["missing_keys"] and not info["unexpected_keys"] and not info["mismatched_keys"], info
    assert_state_equal({f"model.{k}": v for k, v in exported.state_dict().items()}, job.state(), 0.0)


def test_a_modules_to_save_copy_reads_what_its_original_reads(tmp_path):
    # peft starts a modules_to_save copy (task_type="SEQ_CLS": the classifier) as the module it copies: under
    # init_weights the copy and its original both take the checkpoint's classifier, in the strategy's order
    # (matched on the whole module, materialised with what is read next left allocated only, then read)
    from transformers import BertForSequenceClassification

    torch.manual_seed(123)
    HFBertClassifier(n_layers=2).model.save_pretrained(tmp_path / "bert")
    with empty_weights():
        model = LoraBert(n_layers=2)
    pretrained = open_pretrained(tmp_path / "bert", model)
    weights = match_weights(pretrained, model)
    materialize(model, loaded=frozenset(weights.keys))
    load_weights(pretrained, weights, model)
    saved = BertForSequenceClassification.from_pretrained(tmp_path / "bert").classifier
    head = model.model.base_model.model.classifier
    for module in (head.original_module, head.modules_to_save["default"]):
        assert torch.equal(module.weight, saved.weight) and torch.equal(module.bias, saved.bias)
