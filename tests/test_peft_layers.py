"""``layers=`` through peft: the qualified path of a peft model's layers, a short path resolved through peft's
wrapper steps (said once), ambiguity and absence refused; LoRA injected into a seed-convention module trains
under ``split="prune"`` as one process does."""

from __future__ import annotations

import pytest
import torch
from conftest import ok, run_job
from models import LoraGPT, LoraLlama
from test_parity import assert_same_logs, common
from test_tied import assert_state_equal
from torch import nn

from lightning_pp.errors import PipelineConfigError
from lightning_pp.split.planning import check_module
from lightning_pp.split.stage import resolution_note, resolve_layers

LOSS_TOL, PARAM_TOL = 2e-4, 1e-5
FULL = "model.base_model.model.model.layers"


def test_a_peft_models_layers_by_their_qualified_path_or_a_short_one() -> None:
    model = LoraLlama()
    assert resolve_layers(model, FULL) == FULL
    # peft's base_model.model. steps left out, or reached as peft forwards attributes (model.model -> the Llama)
    for short in ("model.model.layers", "model.model.model.layers", "model.base_model.model.layers"):
        assert resolve_layers(model, short) == FULL, short
    check_module(model, "model.model.layers", None, 2)
    note = resolution_note(model, "model.model.layers", FULL)
    assert note == f"layers='model.model.layers' resolved to '{FULL}' (inside a peft model)"


def test_absent_or_ambiguous_layers_name_the_candidates() -> None:
    model = LoraLlama()
    with pytest.raises(PipelineConfigError, match=rf"no attribute 'model.layers'.*'{FULL}'"):
        resolve_layers(model, "model.layers")  # the peft model holds a Llama, whose layers are one step deeper
    # a base model with a container of its own at "layers": model.model.layers could mean either
    model.model.base_model.model.layers = nn.ModuleList([nn.Linear(2, 2), nn.Linear(2, 2)])
    with pytest.raises(PipelineConfigError, match=r"several layer containers") as error:
        check_module(model, "model.model.layers", None, 2)
    assert "'model.base_model.model.layers'" in str(error.value) and f"'{FULL}'" in str(error.value)
    assert resolve_layers(model, FULL) == FULL  # the qualified name stays unambiguous


def test_injected_adapters_keep_the_modules_own_path() -> None:
    model = LoraGPT()
    assert resolve_layers(model, "net.blocks") == "net.blocks"
    assert any(".lora_A." in n for n, _ in model.named_parameters())
    with pytest.raises(PipelineConfigError, match="no attribute 'blocks'.*'net.blocks'"):
        resolve_layers(model, "blocks")  # "net" is the module's own step, not a wrapper's


def test_injected_lora_under_prune_matches_one_process(tmp_path, reference) -> None:
    cfg = dict(model="lora_gpt", layers="net.blocks", split="prune", schedule="1f1b", devices=2, m=2, batch=8,
               n_train=32, n_val=16)  # fmt: skip
    job = ok(run_job({**cfg, "strategy": "pipeline"}, tmp_path / "job"))
    ref = reference(**common(cfg))
    assert_same_logs(job.rank(0), ref, LOSS_TOL)
    state, initial = job.state(), ref["initial"]
    assert_state_equal(state, ref["state"], PARAM_TOL)
    adapters = [k for k in state if ".lora_" in k]
    assert len(adapters) == 16 and all(not torch.equal(state[k], initial[k]) for k in adapters if "lora_B" in k)
    assert all(torch.equal(state[k], initial[k]) for k in state if k not in adapters)  # the base unchanged
