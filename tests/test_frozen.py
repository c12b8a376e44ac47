"""Frozen parameters under every schedule: a fine-tune whose leading parts are frozen (so the first trainable stage
receives an input that carries no gradient) trains as one process fed the same micro-batches, and the frozen tensors
stay as they were. torch's split backward alone gave that stage no gradients (zbv, interleaved_zb) or wrong ones
(dualpipev)."""

from __future__ import annotations

from collections.abc import Callable
from types import SimpleNamespace

import pytest
import torch
from conftest import ok, run_job
from test_parity import common
from test_tied import assert_state_equal, combined
from torch import nn

from lightning_pp.runtime.split_backward import _has_orphan_weights

LOSS_TOL, PARAM_TOL = 2e-4, 1e-5


def _micro(cfg: dict) -> dict:
    """One process fed the pipeline's micro-batches one by one (the same arithmetic, see test_parity)."""
    return {**common(cfg), "batch": cfg["batch"] // cfg["m"], "accumulate": cfg["m"]}


def _assert_trained_as(
    job, ref: dict, trainable: Callable[[str], bool], logged: dict | None = None, replicas: tuple[int, ...] = (0,)
) -> None:
    """Parameters as one process (``ref``) and losses as one process on whole batches (``logged``, else ``ref``;
    the mean of what the first ranks of ``replicas`` logged); every trainable tensor moved, every frozen one exactly
    as it was."""
    state = job.state()
    assert_state_equal(state, ref["state"], PARAM_TOL)
    initial = ref["initial"]
    for key, value in state.items():
        moved = (value - initial[key]).abs().max().item()
        assert (moved > 100 * PARAM_TOL) if trainable(key) else (moved == 0.0), (key, moved)
    steps = [r["train_loss"] for r in (logged or ref)["logged"] if "train_loss" in r]
    seen = [[r["train_loss"] for r in job.rank(rank)["logged"] if "train_loss" in r] for rank in replicas]
    got = [sum(losses) / len(losses) for losses in zip(*seen, strict=True)]
    assert len(got) == len(steps) > 1 and max(abs(a - b) for a, b in zip(got, steps)) <= LOSS_TOL


@pytest.mark.parametrize(
    "schedule,ranks",
    [("1f1b", 2), ("interleaved_1f1b", 2), ("interleaved_zb", 2), ("zbv", 2), ("dualpipev", 4)],
)
def test_frozen_leading_stages_train_exactly_under_every_schedule_family(schedule, ranks, tmp_path, reference):
    # the first half of the blocks and the embedding frozen: with two stages per rank, stage 1 (and 2, 3 at 4
    # ranks) has nothing to train, and the first trainable stage's received input carries no gradient
    stages = ranks * (1 if schedule == "1f1b" else 2)
    cfg = dict(model="frozen", schedule=schedule, devices=ranks, m=stages, batch=stages * 2, n_train=stages * 6,
               n_val=stages * 2, n_layers=stages)  # fmt: skip
    job = ok(run_job({**cfg, "strategy": "pipeline"}, tmp_path / "job", timeout=300))
    frozen = ("net.embed.weight", "net.pos", *(f"net.blocks.b{i}." for i in range(stages // 2)))
    _assert_trained_as(job, reference(**_micro(cfg)), lambda key: not key.startswith(frozen), reference(**common(cfg)))


def test_frozen_leading_stages_under_2bw(tmp_path, reference):
    cfg = dict(
        model="frozen", devices=2, m=4, batch=8, n_train=32, n_val=8, sanity=0, optimizer="sgd", lr=0.05, n_layers=2
    )
    job = ok(run_job({**cfg, "strategy": "pipeline", "schedule": "2bw"}, tmp_path / "job", timeout=240))
    frozen = ("net.embed.weight", "net.pos", "net.blocks.b0.")
    _assert_trained_as(job, reference(**common(cfg), reference_2bw=True), lambda key: not key.startswith(frozen))


@pytest.mark.parametrize("layout", ["ddp", "tp"])
def test_frozen_leading_stages_with_replicas_or_tensor_parallel_under_zbv(layout, tmp_path, reference):
    # 2 stages per rank on 2 pipeline ranks, x2 DDP replicas (a stage with nothing to train has nothing to average)
    # or x2 tensor-parallel shards of each block's MLP (frozen DTensors in the first stages)
    cfg = dict(model="frozen_tp" if layout == "tp" else "frozen", schedule="zbv", devices=4, pp=2, m=4, batch=8,
               n_train=24, n_val=8)  # fmt: skip
    cfg.update(tp=2) if layout == "tp" else cfg.update(data_parallel="ddp")
    job = ok(run_job({**cfg, "strategy": "pipeline"}, tmp_path / "job", timeout=300))
    ref = reference(**(combined(cfg) if layout == "ddp" else common(cfg)))
    frozen = ("net.embed.weight", "net.pos", "net.blocks.b0.", "net.blocks.b1.")
    _assert_trained_as(job, ref, lambda key: not key.startswith(frozen), replicas=(0, 2) if layout == "ddp" else (0,))


LORA = dict(model="lora_llama", split="trace", layers="model.base_model.model.model.layers", n_val=8)


@pytest.mark.parametrize("schedule,model", [("zbv", "lora_llama"), ("dualpipev", "dora_llama")])
def test_lora_on_the_later_layers_of_a_traced_llama_under_v_schedules(schedule, model, tmp_path, reference):
    # adapters on layers 2 and 3 only: stages 0 and 1 (embedding, layers 0-1) train nothing. DoRA's magnitude module
    # calls its layer's lora_A and lora_B, which torch's unflattening refused in the trace ("not a descendant");
    # transformers' gradient checkpointing of layers 0 and 2, which the trace left out, recomputes them
    cfg = dict(LORA, model=model, schedule=schedule, devices=2, m=4, batch=8, n_train=24, n_layers=4)
    job = ok(run_job({**cfg, "strategy": "pipeline"}, tmp_path / "job", timeout=300))
    said = "2 of 4 layers have transformers' gradient checkpointing on (gradient_checkpointing_enable()): each rank's"
    assert job.output.count(said) == (model == "dora_llama"), job.output[-3000:]
    _assert_trained_as(job, reference(**_micro(cfg)), lambda key: ".lora_" in key, reference(**common(cfg)))


def test_lora_with_fsdp_replicas_trains_as_one_process_on_their_combined_batch(tmp_path, reference):
    # 2 replicas (FSDP2 over them) x 2 stages: the adapters' gradients reduce-scattered, the frozen base sharded;
    # validation batches of 2 per replica beside training's 4 (each signature's traced pieces on one FSDP root)
    cfg = dict(LORA, schedule="1f1b", devices=4, pp=2, data_parallel="fsdp", m=2, batch=4, n_train=24, n_layers=4,
               n_val=4)  # fmt: skip
    job = ok(run_job({**cfg, "strategy": "pipeline"}, tmp_path / "job", timeout=300))
    _assert_trained_as(job, reference(**combined(cfg)), lambda key: ".lora_" in key, replicas=(0, 2))


def test_a_weight_whose_path_misses_the_stage_input_is_found():
    # torch's split backward keeps, per weight, where its path meets the input's; "bias" below never meets it
    class TwoOutputs(nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.proj, self.bias = nn.Linear(4, 4), nn.Parameter(torch.ones(4))

        def forward(self, x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
            return self.proj(x), self.bias * 2

    module = TwoOutputs()
    x = torch.randn(2, 4, requires_grad=True)
    stage = SimpleNamespace(submod=module)
    assert _has_orphan_weights(stage, {"stage_output": module(x), "input_values": [x]})
    module.bias.requires_grad_(False)
    assert not _has_orphan_weights(stage, {"stage_output": module(x), "input_values": [x]})
