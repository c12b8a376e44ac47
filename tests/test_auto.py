"""``schedule="auto"``: the first batch measures the model, simulates every layout and every rank runs rank 0's
choice, which trains as one process with the chosen arguments and stays when the run resumes; a memory limit
keeps the choice under it or refuses on every rank."""

from __future__ import annotations

import importlib
import logging
import math
import re
import sys

import pytest
import torch
from conftest import ok, run_job
from models import HFOPT, MOE, HFLlama, HFMoEEager, LoraLlama, TinyGPT, loader
from test_parity import common
from test_tied import assert_state_equal, combined

from lightning_pp import PipelineStrategy
from lightning_pp.choose.auto import _measured_here
from lightning_pp.choose.costs import counted_costs, profile_module, save_costs, saved_costs
from lightning_pp.choose.machine import Machine, device_speed
from lightning_pp.choose.planner import ModelCosts, plan
from lightning_pp.errors import PipelineConfigError
from lightning_pp.layout.options import Forecast
from lightning_pp.runtime.forecast import _say
from lightning_pp.split.profiling import DeviceSpeed, Segments

SPEED = DeviceSpeed(1e12, 1e-6)  # FLOPs and operations both count
AUTO = dict(schedule="auto", activation_checkpointing="auto", devices=2, batch=8, n_train=40, n_val=8, n_layers=4)


def test_auto_chooses_one_layout_for_every_rank_trains_as_one_process_and_resumes_with_it(tmp_path, reference):
    job = ok(run_job({**AUTO, "strategy": "pipeline"}, tmp_path / "a", timeout=300))
    chosen = job.rank(0)["chosen"]
    assert job.rank(1)["chosen"] == chosen and sum(chosen["balance"]) == 4, chosen
    assert job.output.count("schedule='auto' chose") == 1 and "runner-up" in job.output
    # the prediction against the first steps, said once (5 steps: timed from the second to the fifth's start)
    assert job.output.count("training steps 2-4 took") == 1, job.output[-3000:]
    assert re.search(r"the highest peak was \d+ MiB on rank [01] \([+-]\d+% of its predicted \d+ MiB\)", job.output)
    m = chosen["n_microbatches"]
    ref = reference(**{**common(AUTO), "batch": AUTO["batch"] // m, "accumulate": m})  # its micro-batches, one process
    assert_state_equal(job.state(), ref["state"], 1e-5)
    resumed = {**AUTO, "resume": str(job.out / "final.ckpt"), "max_epochs": 2, "strategy": "pipeline"}
    again = ok(run_job(resumed, tmp_path / "b", timeout=300))
    assert "The resumed checkpoint's choice stands" in again.output and "schedule='auto' chose" not in again.output
    assert again.rank(0)["chosen"] == again.rank(1)["chosen"] == chosen


def test_auto_with_replicas_chooses_one_layout_for_all_four_ranks(tmp_path, reference):
    # 2 replicas x 2 stages: each replica's pipeline times its own message, rank 0's choice reaches all four
    cfg = dict(AUTO, devices=4, pp=2, batch=4, n_train=24)
    job = ok(run_job({**cfg, "strategy": "pipeline"}, tmp_path / "job", timeout=300))
    chosen = job.rank(0)["chosen"]
    assert all(job.rank(r)["chosen"] == chosen for r in range(4)), [job.rank(r)["chosen"] for r in range(4)]
    assert_state_equal(job.state(), reference(**combined(cfg))["state"], 1e-5)


def test_auto_on_four_pipeline_ranks_chooses_one_layout_and_trains_as_one_process(tmp_path, reference):
    cfg = dict(AUTO, devices=4, n_layers=8)
    job = ok(run_job({**cfg, "strategy": "pipeline"}, tmp_path / "job", timeout=300))
    chosen = job.rank(0)["chosen"]
    assert all(job.rank(r)["chosen"] == chosen for r in range(4)), [job.rank(r)["chosen"] for r in range(4)]
    assert len(chosen["balance"]) == 4 * chosen["stages_per_rank"] and sum(chosen["balance"]) == 8, chosen
    m = chosen["n_microbatches"]
    ref = reference(**{**common(cfg), "batch": cfg["batch"] // m, "accumulate": m})
    assert_state_equal(job.state(), ref["state"], 1e-5)


def test_a_memory_limit_nothing_fits_under_is_refused_on_every_rank(tmp_path):
    # bf16-mixed with a training batch first (no sanity check): measured under autocast, as training runs
    cfg = {**AUTO, "memory_limit": 2**20, "precision": "bf16-mixed", "sanity": 0, "strategy": "pipeline"}
    job = run_job(cfg, tmp_path / "job", timeout=300, env={"LIGHTNING_PP_CACHE": str(tmp_path / "cache")})
    assert job.returncode != 0
    said = "memory_limit=1048576 (1 MiB per rank): no layout is predicted to fit"
    assert job.output.count(said) >= 2 and "the smallest predicted peak is" in job.output, job.output[-3000:]
    model, batch = TinyGPT(n_layers=4), next(iter(loader(AUTO["n_train"], AUTO["batch"], seed=0)))
    with pytest.MonkeyPatch.context() as env:
        env.setenv("LIGHTNING_PP_CACHE", str(tmp_path / "cache"))
        assert saved_costs(model, batch, "net.blocks") is None  # not a 32-true run's costs
        with torch.autocast("cpu", torch.bfloat16):
            saved = saved_costs(model, batch, "net.blocks")
    assert saved is not None
    full = profile_module(model, batch, "net.blocks", [AUTO["batch"]]).measured[0]
    [mixed] = [s for s in saved.measured if s.size == AUTO["batch"]]
    assert sum(mixed.saved_bytes[1:-1]) < 0.8 * sum(full.saved_bytes[1:-1]), (mixed.saved_bytes, full.saved_bytes)


def test_a_rank_that_cannot_measure_the_model_stops_every_rank_with_its_error(tmp_path):
    # every rank measures at once: the last one's failure is every rank's error, none waits for a choice
    job = run_job({**AUTO, "model": "last_rank_fails", "strategy": "pipeline"}, tmp_path / "job", timeout=300)
    assert job.returncode != 0
    said = "schedule='auto' could not measure the model on rank 1 (RuntimeError: this step fails on the last rank)"
    assert job.output.count(said) >= 2, job.output[-3000:]


def _costs(layers: int = 8, saved: int = 64 << 20) -> ModelCosts:
    """Equal layers whose saved activations dominate: under 1F1B the first rank holds the most of them."""
    n = layers + 2
    zero = (0,) * n
    segments = Segments(
        size=1,
        forward=(0.001,) * n,
        backward=(0.002,) * n,
        input_grad=(0.001,) * n,
        weight_grad=(0.001,) * n,
        saved_bytes=(0, *([saved] * layers), 0),
        boundary_bytes=(1 << 20,) * n,
        param_bytes=zero,
    )
    return ModelCosts((segments,), 0.0, 0.0)


def test_a_memory_limit_moves_layers_off_the_ranks_that_hold_the_most_in_flight():
    costs, machine = _costs(), Machine(1e-4, 1e9, 1e-4, 0.0, 0)
    free = plan(costs, machine, 2, 4, schedules=["1f1b"], microbatches=[4], activation_checkpointing=[False],
                data_parallel=["ddp"])  # fmt: skip
    even = next(p for p in free if p.config.balance == (4, 4))
    assert even.peak_bytes[0] > even.peak_bytes[1]  # rank 0 holds 2 micro-batches in flight, rank 1 one
    limit = (even.peak_mib + max(p.peak_bytes[1] for p in free) / 2**20) / 2
    capped = plan(costs, machine, 2, 4, limit, schedules=["1f1b"], microbatches=[4], activation_checkpointing=[False],
                  data_parallel=["ddp"])  # fmt: skip
    assert capped and all(p.peak_mib <= limit for p in capped)
    best = capped[0].config
    assert best.balance_mode == "memory" and best.balance[0] < best.balance[1], best


@pytest.mark.parametrize(
    "kwargs,message",
    [
        (dict(memory_limit="80%"), r"memory_limit='80%' with nothing to choose"),
        (dict(schedule="auto", memory_limit="lots"), r"memory_limit='lots': give the bytes a rank may hold"),
        (dict(schedule="auto", memory_limit=0), r"memory_limit=0: give the bytes"),
        (dict(schedule="auto", tensor_parallel_size=2), r"the planner does not model tensor or expert parallelism"),
    ],
)
def test_auto_arguments_that_cannot_work_are_refused_when_the_strategy_is_built(kwargs, message):
    with pytest.raises(PipelineConfigError, match=message):
        PipelineStrategy(**kwargs)


def test_until_the_first_batch_auto_arguments_stand_in_as_one_stage_per_rank_under_1f1b():
    strategy = PipelineStrategy(schedule="auto", memory_limit="80%")
    o = strategy.options
    assert (o.schedule, o.stages_per_rank, o.n_microbatches, o.balance) == ("1f1b", 1, None, None)
    assert o.auto == {"schedule", "n_microbatches", "stages_per_rank", "balance"} and not o.planned
    looped = PipelineStrategy(schedule="auto", stages_per_rank=4, n_microbatches=8).options
    assert (looped.schedule, looped.stages_per_rank, looped.auto) == ("interleaved_1f1b", 4, {"schedule", "balance"})


def test_auto_on_a_traced_hf_llama_chooses_one_layout_and_trains_as_one_process(tmp_path, reference):
    cfg = dict(AUTO, model="llama", split="trace", layers="model.model.layers", optimizer="sgd")
    job = ok(run_job({**cfg, "strategy": "pipeline"}, tmp_path / "job", timeout=300))
    chosen = job.rank(0)["chosen"]
    assert job.rank(1)["chosen"] == chosen and sum(chosen["balance"]) == 4, chosen
    m = chosen["n_microbatches"]
    ref = reference(**{**common(cfg), "batch": cfg["batch"] // m, "accumulate": m})
    assert_state_equal(job.state(), ref["state"], 1e-5)


def test_a_models_measured_costs_are_kept_per_model_and_batch_shape(tmp_path, monkeypatch):
    # a restarted run (no checkpoint yet) plans from what the first attempt measured
    monkeypatch.setenv("LIGHTNING_PP_CACHE", str(tmp_path))
    model = TinyGPT(n_layers=2)
    batch = {"tokens": torch.zeros(4, 8, dtype=torch.long), "targets": torch.zeros(4, 8, dtype=torch.long)}
    assert saved_costs(model, batch, "net.blocks") is None
    costs = profile_module(model, batch, "net.blocks", [2, 4])
    save_costs(costs, model, batch, "net.blocks")
    assert saved_costs(model, batch, "net.blocks") == costs
    longer = {k: torch.zeros(4, 16, dtype=torch.long) for k in batch}
    assert (
        saved_costs(model, longer, "net.blocks") is None
        and saved_costs(TinyGPT(n_layers=3), batch, "net.blocks") is None
    )
    # the user's file edited between runs (the same parameters, another step): measured again
    source = tmp_path / "user_model.py"
    monkeypatch.syspath_prepend(str(tmp_path))
    edited = []
    for loss in ("h.square().mean()", "h.abs().mean()"):
        source.write_text(_USER_MODEL.format(loss=loss))
        sys.modules.pop("user_model", None)
        user = importlib.import_module("user_model").Model()
        x = torch.ones(4, 8)
        edited.append(saved_costs(user, x, "layers"))
        save_costs(profile_module(user, x, "layers", [4]), user, x, "layers")
    assert edited == [None, None] and saved_costs(user, x, "layers") is not None


_USER_MODEL = """
import lightning as L
import torch
from torch import nn


class Model(L.LightningModule):
    def __init__(self):
        super().__init__()
        self.layers = nn.ModuleList(nn.Linear(8, 8) for _ in range(2))

    def training_step(self, x, i):
        h = x
        for layer in self.layers:
            h = layer(h)
        return {loss}

    def configure_optimizers(self):
        return torch.optim.SGD(self.parameters(), lr=0.1)
"""


@pytest.mark.parametrize("family", ["qwen2_moe", "opt"])
def test_hf_models_are_measured_as_the_pipeline_runs_them(family):
    # Qwen2-MoE at the config's default use_cache=True: the eager forward built a cache whose concatenations joined
    # torch's split-backward groups, and the weight pass failed ("backward through the graph a second time"); the
    # pipeline's traced copy runs without the cache, and so does the profile now. OPT's layers return a view, which
    # the input pass detached in place ("Can't detach views in-place"); a stage hands on no view. "auto" refused both
    model = MOE["qwen2_moe"](n_layers=2) if family == "qwen2_moe" else HFOPT(n_layers=2)
    model.model.config.use_cache = True
    batch = {"tokens": torch.randint(0, 32, (4, 8)), "targets": torch.randint(0, 32, (4, 8))}
    costs = profile_module(model, batch, None, [2])
    assert len(costs.measured[0].forward) == 4 and all(t > 0 for t in costs.measured[0].weight_grad)
    assert model.model.config.use_cache is True  # the user's config as it was


def test_a_module_too_large_to_bring_to_the_ranks_device_is_costed_by_its_flops_and_left_as_it_was():
    # built on the CPU for a GPU run: moved to the GPU for the profile when it fits easily, else its FLOPs are
    # counted through fake stand-ins of its tensors (timed on the CPU, the costs were the CPU's, and took minutes)
    gib, cpu, gpu = 2**30, torch.device("cpu"), torch.device("cuda", 0)
    assert _measured_here(cpu, gpu, 6 * gib, 80 * gib) and not _measured_here(cpu, gpu, 7 * gib, 80 * gib)
    assert _measured_here(cpu, cpu, 70 * gib, 0)  # trained where it is: timed there
    torch.manual_seed(0)
    model = TinyGPT(n_layers=3)
    before = {k: v.clone() for k, v in model.state_dict().items()}
    batch = {"tokens": torch.zeros(4, 8, dtype=torch.long), "targets": torch.zeros(4, 8, dtype=torch.long)}
    counted = counted_costs(model, batch, "net.blocks", [1, 4], SPEED, cpu)
    with torch.device("meta"):
        built = TinyGPT(n_layers=3)
    assert counted == counted_costs(built, batch, "net.blocks", [1, 4], SPEED, cpu)
    assert counted.measured[1].forward[1] > 0 and counted.measured[1].saved_bytes[1] > 0
    profiled = profile_module(model, batch, "net.blocks", [1, 4])  # what a step saves, counted as a real one saves it
    assert [c.saved_bytes for c in counted.measured] == [c.saved_bytes for c in profiled.measured]
    assert [c.backward_bytes for c in counted.measured] == [c.backward_bytes for c in profiled.measured]
    after = model.state_dict()
    assert all(after[k].device == cpu and torch.equal(after[k], v) for k, v in before.items())


def test_a_counted_step_costs_each_operation_it_dispatches_beside_its_flops():
    # a small model's layers are mostly their operations' own cost (the default app's 64-wide GPT ran each layer 15x
    # its FLOPs' time at one sample): counted in FLOPs alone, schedule="auto" predicted its step at a fifth of what
    # it took (0.018 s against 0.088 s)
    batch = {"tokens": torch.zeros(4, 8, dtype=torch.long), "targets": torch.zeros(4, 8, dtype=torch.long)}
    with torch.device("meta"):
        built = TinyGPT(n_layers=3)
    cpu = torch.device("cpu")
    ops, flops, both = (
        counted_costs(built, batch, "net.blocks", [1, 4], speed, cpu).measured
        for speed in (DeviceSpeed(math.inf, 1.0), DeviceSpeed(1.0, 0.0), DeviceSpeed(1.0, 1.0))
    )
    for o, f, b in zip(ops, flops, both, strict=True):
        assert b.forward == tuple(x + y for x, y in zip(o.forward, f.forward)), (o, f, b)
        assert b.backward == tuple(x + y for x, y in zip(o.backward, f.backward)), (o, f, b)
    blocks = ops[0].forward[1:4]
    assert len(set(blocks)) == 1 and blocks[0] >= 10 and ops[0].backward[1] > blocks[0], ops[0]
    assert ops[1].forward == ops[0].forward and ops[1].backward == ops[0].backward  # as many for 4 samples as for 1
    # split in two as torch's zero-bubble schedules run it (input, then weight pass), a block's backward dispatches
    # more operations than whole; taken as two equal halves, those schedules looked cheaper than they run
    halves = [ops[0].input_grad[1], ops[0].weight_grad[1]]
    assert min(halves) > 0 and sum(halves) > ops[0].backward[1] and halves[0] != halves[1], ops[0]
    assert flops[1].forward[1] == 4 * flops[0].forward[1] > 0  # FLOPs grow with the micro-batch
    speed = device_speed(cpu, torch.float32)
    assert speed.flops_per_s > 1e8 and 0 < speed.seconds_per_op < 1e-3, speed


@pytest.mark.parametrize("model", [HFLlama, LoraLlama])
def test_hf_models_built_on_meta_are_costed_by_their_flops(model):
    # Hugging Face's forward reads the positions' values (packed sequences) unless its tensors are fake: on meta
    # tensors it stopped with "Tensor.item() cannot be called on meta tensors"
    batch = {"tokens": torch.zeros(4, 8, dtype=torch.long), "targets": torch.zeros(4, 8, dtype=torch.long)}
    torch.manual_seed(0)
    eager = model(n_layers=3)
    with torch.device("meta"):
        built = model(n_layers=3)
    counted = counted_costs(built, batch, None, [1, 4], SPEED, torch.device("cpu"))
    assert counted == counted_costs(eager, batch, None, [1, 4], SPEED, torch.device("cpu"))
    assert all(f > 0 for f in counted.measured[1].forward[1:4]), counted.measured[1]


def test_a_step_that_asks_values_cannot_be_costed_without_data_and_says_what_to_change():
    # transformers' eager experts loop over the experts hit (nonzero): fake tensors have no values to ask, and the
    # error was torch's own ("DynamicOutputShapeException: aten.nonzero.default")
    batch = {"tokens": torch.zeros(4, 8, dtype=torch.long), "targets": torch.zeros(4, 8, dtype=torch.long)}
    with torch.device("meta"):
        built = HFMoEEager(n_layers=2)
    said = r"HFMoEEager's step asks its tensors' values \(aten.nonzero.default\), .* experts_implementation='eager'"
    with pytest.raises(PipelineConfigError, match=said + r".*'grouped_mm'.*'batched_mm'"):
        counted_costs(built, batch, None, [1, 4], SPEED, torch.device("cpu"))


def test_auto_measures_a_lora_model_built_on_meta_and_trains_as_one_process(tmp_path, reference):
    # peft's LoRA on a Llama, built on meta and read from a saved one, with the defaults but schedule="auto": small
    # enough to be materialised on the rank's device for the profile (counted, a layer's Python was missed: +236%
    # against the step measured through the app), then back on meta for each rank's stage
    torch.manual_seed(123)
    HFLlama().model.save_pretrained(tmp_path / "llama")
    cfg = dict(AUTO, model="lora_llama", layers=None, split=None, build="init_module", optimizer="sgd", lr=0.5,
               pretrained=str(tmp_path / "llama"))  # fmt: skip
    job = ok(run_job({**cfg, "strategy": "pipeline"}, tmp_path / "job", timeout=300))
    assert "from the first batch's costs on the module materialised on cpu" in job.output, job.output[-3000:]
    chosen = job.rank(0)["chosen"]
    assert job.rank(1)["chosen"] == chosen and job.rank(0)["meta_params"] == 0, chosen
    m = chosen["n_microbatches"]
    ref = reference(**{**common(cfg), "batch": cfg["batch"] // m, "accumulate": m})["state"]
    state = job.state()  # the adapters (the frozen base is left out of the checkpoint)
    assert len(state) == 8 and all(".lora_" in k for k in state), sorted(state)
    assert_state_equal(state, {k: ref[k] for k in state}, 1e-5)


def test_a_rank_over_the_memory_limit_is_warned_of_beside_the_prediction(caplog):
    forecast = Forecast(step_s=0.5, peak_mib=(400.0, 600.0), limit_mib=700.0)
    with caplog.at_level(logging.INFO, logger="lightning.pytorch.pipeline"):
        _say(forecast, 0.55, [(0, 420.0), (1, 750.0), (0, 500.0), (1, 690.0)])  # 2 replicas x 2 stages
    said = caplog.text
    assert "predicted 0.500 s a step and a peak of 600 MiB per rank; training steps 2-4 took 0.550 s (+10%)" in said
    assert "the highest peak was 750 MiB on rank 1 (+25% of its predicted 600 MiB)" in said
    over = [r for r in caplog.records if r.levelno == logging.WARNING]
    assert len(over) == 1 and "Rank 1 peaked at 750 MiB, over memory_limit's 700 MiB" in over[0].getMessage()
    caplog.clear()
    with caplog.at_level(logging.INFO, logger="lightning.pytorch.pipeline"):
        _say(forecast, 0.5, [(0, 0.0), (1, 0.0)])  # no high-water mark kept (not Linux): the time alone
    assert "took 0.500 s (+0%)." in caplog.text
    assert "peak was" not in caplog.text and "over memory_limit" not in caplog.text
