"""The planner: profiled costs, the memory model against benchmarks/memory.py's measurement, configurations torch
and the app accept, planning from entered costs, and ``python -m lightning_pp.plan`` end to end."""

from __future__ import annotations

import csv
import json
from dataclasses import replace
from pathlib import Path

import pytest
import torch
from conftest import run_module, run_script
from hydra import compose, initialize_config_module
from hydra.utils import instantiate
from torch import nn

from lightning_pp import PipelineStrategy
from lightning_pp.choose.costs import profile_module
from lightning_pp.choose.machine import Machine
from lightning_pp.choose.planner import Config, ModelCosts, configurations, plan, predict
from lightning_pp.examples.gpt import GPT
from lightning_pp.layout.schedule import check_microbatches, resolve_stages_per_rank
from lightning_pp.plan.app import COLUMNS, _training_precision, entered_costs, plan_module
from lightning_pp.plan.calibrate import fit_nonnegative
from lightning_pp.split.partition import uniform_split
from lightning_pp.split.profiling import _Clock, _last_level_cache_bytes

ROOT = Path(__file__).parents[1]
# benchmarks/common.py's model and batch, which benchmarks/memory.py measured
BENCHMARK_MODEL = dict(vocab=1000, dim=256, n_layers=8, n_heads=4, seq_len=64)
QUIET = Machine(latency_s=1e-4, bandwidth_bytes_per_s=1e9, action_overhead_s=0.0, step_overhead_s=0.0, base_bytes=0)


def tokens(batch: int, seq_len: int, vocab: int) -> tuple[torch.Tensor, torch.Tensor]:
    x = torch.randint(0, vocab, (batch, seq_len + 1), generator=torch.Generator().manual_seed(0))
    return x[:, :-1], x[:, 1:]


@pytest.fixture(scope="module")
def benchmark_costs() -> ModelCosts:
    torch.manual_seed(0)
    model = GPT(**BENCHMARK_MODEL)
    return profile_module(model, tokens(32, 64, 1000), "layers", [2, 4])


def test_profiled_costs_scale_with_the_micro_batch_and_count_every_parameter(benchmark_costs):
    small, large = benchmark_costs.measured
    assert (small.size, large.size) == (2, 4)
    n = benchmark_costs.n_layers
    assert n == 8 and len(small.forward) == n + 2
    # what autograd saves and what a stage sends grow with the samples, exactly (the token ids the embedding
    # saves are a view of the whole batch: autograd keeps that storage whatever the micro-batch)
    assert [2 * s for s in small.saved_bytes[1:-1]] == list(large.saved_bytes[1:-1])
    assert 2 * small.saved_bytes[-1] == pytest.approx(large.saved_bytes[-1], rel=1e-3)
    assert large.boundary_bytes[:n] == (4 * 64 * 256 * 4,) * n  # (4 samples, 64 tokens, d=256, fp32) per cut
    assert benchmark_costs.at(3).saved_bytes[1:-1] == tuple(s * 3 / 2 for s in small.saved_bytes[1:-1])
    # the embedding before the layers, the norm and head after them, every layer's own weights
    model = GPT(**BENCHMARK_MODEL)
    assert sum(large.param_bytes) == sum(p.nbytes for p in model.parameters())
    assert large.param_bytes[0] == model.tok_embeddings.weight.nbytes
    assert large.param_bytes[-1] == sum(p.nbytes for p in (*model.norm.parameters(), *model.output.parameters()))
    assert all(t > 0 for t in large.forward + large.backward + large.input_grad + large.weight_grad)
    # AdamW keeps two moments (and a step count) per weight
    assert benchmark_costs.optimizer_state_ratio == pytest.approx(2.0, abs=0.01)
    # what each part's backward holds beyond what it saved, net of the saved tensors it frees meanwhile: a layer's
    # weight and activation gradients; the head's weight gradient and its logits' (4 samples x 64 tokens x 1000 in
    # fp32), which the peak adds on top
    layers = zip(large.backward_bytes[1:-1], large.param_bytes[1:-1], large.saved_bytes[1:-1])
    assert all(0 < b <= p + saved for b, p, saved in layers)
    logits = 4 * 64 * 1000 * 4
    assert logits <= large.backward_bytes[-1] <= large.param_bytes[-1] + 3 * logits
    config = Config(2, "1f1b", 1, 8, (4, 4), "uniform", False)
    unseen = replace(benchmark_costs, measured=tuple(replace(s, backward_bytes=()) for s in benchmark_costs.measured))
    added = [a - b for a, b in zip(*(predict(config, c, QUIET, 32, 2).peak_bytes for c in (benchmark_costs, unseen)))]
    at_4 = benchmark_costs.at(4).backward_bytes  # each rank's costliest part: a layer here, at 4 samples a micro-batch
    assert added == pytest.approx([max(at_4[:5]), max(at_4[5:])], abs=1)


def test_the_profile_clock_clears_the_cache_for_a_model_that_outgrows_it_and_leaves_that_time_out():
    cache = _last_level_cache_bytes(torch.device("cpu"))
    assert cache >= 1 << 20
    warm = _Clock(torch.device("cpu"), nn.Linear(8, 8))
    warm.cold(torch.ones(8))
    assert warm._cold_s == 0.0  # weights and gradients fit the cache: a pipeline finds them there too
    outgrows = _Clock(torch.device("cpu"), nn.Linear(cache // 4 // 1024, 1024, bias=False))
    start = outgrows.now()
    outgrows.cold(torch.ones(1000))
    # reading a buffer twice the last-level cache takes milliseconds: none of it is a segment's
    assert outgrows._cold_s > 0 and outgrows.now() - start < outgrows._cold_s / 5


@pytest.mark.parametrize("schedule", ["gpipe", "1f1b", "interleaved_1f1b", "zbv"])
def test_activation_memory_matches_the_benchmark_s_measurement(benchmark_costs, schedule):
    # benchmarks/memory.py: p = 2, m = 8, batch 32, the peak of saved activations per rank through the Trainer
    measured = json.loads((ROOT / "benchmarks/results/memory.json").read_text())["peak_saved_bytes"][schedule]
    v = resolve_stages_per_rank(schedule, None)
    config = Config(2, schedule, v, 8, tuple(uniform_split(8, 2 * v)), "uniform", False)
    predicted = predict(config, benchmark_costs, QUIET, 32, 2).activation_bytes
    assert predicted == pytest.approx(measured, rel=0.10)


def test_configurations_are_what_torch_and_the_app_accept():
    rows = list(configurations(n_layers=8, devices=4, batch_size=16))
    assert {c.schedule for c in rows} >= {"gpipe", "1f1b", "interleaved_1f1b", "interleaved_zb", "zbv", "dualpipev"}
    assert {c.pipeline_parallel_size for c in rows} == {2, 4}
    assert all(c.pipeline_parallel_size * c.stages_per_rank <= 8 for c in rows)
    for c in rows:
        check_microbatches(c.schedule, c.n_microbatches, c.pipeline_parallel_size, len(c.balance))
    # each row's overrides build exactly that strategy through the app's config
    picked = [c for c in rows if c.schedule in ("zbv", "looped_bfs") and c.activation_checkpointing][:2]
    for c in picked + [Config(2, "1f1b", 1, 4, (3, 5), "profile", False)]:
        with initialize_config_module("lightning_pp.conf", version_base="1.3"):
            cfg = compose("config", overrides=["trainer.devices=4", *c.overrides().split()])
        strategy = instantiate(cfg.strategy)
        assert isinstance(strategy, PipelineStrategy)
        assert (strategy.schedule, strategy.n_microbatches) == (c.schedule, c.n_microbatches)
        assert cfg.strategy.pipeline_parallel_size == c.pipeline_parallel_size
        assert cfg.strategy.stages_per_rank == c.stages_per_rank
        assert cfg.strategy.activation_checkpointing == c.activation_checkpointing
        assert cfg.strategy.balance == ("uniform" if c.balance_mode == "uniform" else list(c.balance))


def test_plan_ranks_by_predicted_throughput_and_keeps_within_the_memory_limit(benchmark_costs):
    machine = Machine(1e-4, 1e9, 2e-4, 1e-3, 300 << 20)
    rows = plan(benchmark_costs, machine, 2, 32, microbatches=[2, 4, 8])
    rates = [p.samples_per_s for p in rows]
    assert rates == sorted(rates, reverse=True)
    assert all(p.samples_per_s == pytest.approx(32 / p.step_s) for p in rows)
    # the same micro-batches: GPipe holds all of them, 1F1B at most p per rank; recomputation holds less again
    by = {(p.config.schedule, p.config.n_microbatches, p.config.activation_checkpointing, p.config.balance_mode): p
          for p in rows}  # fmt: skip
    assert by["gpipe", 8, False, "uniform"].peak_mib > by["1f1b", 8, False, "uniform"].peak_mib
    assert by["1f1b", 8, True, "uniform"].peak_mib < by["1f1b", 8, False, "uniform"].peak_mib
    assert by["1f1b", 8, True, "uniform"].step_s > by["1f1b", 8, False, "uniform"].step_s  # one more forward
    limit = sorted(p.peak_mib for p in rows)[len(rows) // 2]
    kept = plan(benchmark_costs, machine, 2, 32, memory_limit_mib=limit, microbatches=[2, 4, 8])
    assert 0 < len(kept) < len(rows) and all(p.peak_mib <= limit for p in kept)


def test_entered_costs_plan_hardware_this_machine_does_not_have():
    with initialize_config_module("lightning_pp.conf", version_base="1.3"):
        cfg = compose("plan", overrides=["costs=llama3_70b_h100"])
    costs, machine = entered_costs(cfg.costs)
    assert costs.n_layers == 80 and machine.bandwidth_bytes_per_s == 5e10
    rows = plan(
        costs, machine, 64, 64, 80 * 1024, pipeline_sizes=[8, 16], schedules=["1f1b", "zbv"], microbatches=[16, 64]
    )
    assert rows and all(p.peak_mib <= 80 * 1024 for p in rows)
    # 70B of bf16 weights with fp32 Adam state fit 80 GB ranks only with the optimizer state sharded over replicas
    assert {p.config.data_parallel for p in rows} == {"fsdp"}
    best = rows[0]
    replicas = 64 // best.config.pipeline_parallel_size
    assert best.samples_per_s == pytest.approx(64 * replicas / best.step_s)  # every replica's batch


def test_the_planner_app_writes_a_ranked_plan_whose_rows_run(tmp_path):
    overrides = ["plan.schedules=[1f1b,gpipe,zbv]", "plan.microbatches=[2,4]", "plan.activation_checkpointing=[false]",
                 "plan.verify_top=1", "plan.verify_steps=4", "plan.calibrate_steps=4", "plan.top=5",
                 "data.n_train=64"]  # fmt: skip
    run = run_module("lightning_pp.plan", [*overrides, f"hydra.run.dir={tmp_path}"], tmp_path, timeout=400)
    assert run.returncode == 0, run.stderr[-3000:]
    last = run.stdout.strip().splitlines()[-1]
    assert last == f"plan: {tmp_path / 'plan.csv'}"
    with (tmp_path / "plan.csv").open() as f:
        rows = list(csv.DictReader(f))
    assert set(COLUMNS) | {"measured_samples_per_s"} <= set(rows[0])
    assert {r["schedule"] for r in rows} == {"1f1b", "gpipe", "zbv"}
    rates = [float(r["predicted_samples_per_s"]) for r in rows]
    assert rates == sorted(rates, reverse=True) and [int(r["rank"]) for r in rows] == list(range(1, len(rows) + 1))
    assert float(rows[0]["measured_samples_per_s"]) > 0 and not rows[1]["measured_samples_per_s"]
    ran = json.loads((tmp_path / "verify" / "1" / "result.json").read_text())  # the first row, through the app
    assert (ran["schedule"], ran["n_microbatches"]) == (rows[0]["schedule"], int(rows[0]["n_microbatches"]))
    assert (tmp_path / "plan.png").stat().st_size > 0
    # the runtime's costs were fitted to three runs of this model: 1F1B with few and many micro-batches, and ZB
    ran = [json.loads((tmp_path / "calibrate" / str(i) / "result.json").read_text()) for i in range(3)]
    assert [(r["schedule"], r["n_microbatches"]) for r in ran] == [("1f1b", 2), ("1f1b", 16), ("interleaved_zb", 16)]
    machine = json.loads((tmp_path / "costs.json").read_text())["machine"]
    assert min(machine.values()) >= 0 and machine["step_overhead_s"] + machine["message_overhead_s"] > 0


@pytest.mark.parametrize(
    "trainer,autocast",
    [("trainer.precision=bf16-mixed", torch.bfloat16), ("trainer=cpu_fp16", torch.float16), ("trainer=cpu", None)],
)
def test_the_planner_app_profiles_the_step_in_the_trainers_precision(tmp_path, trainer, autocast):
    with initialize_config_module("lightning_pp.conf", version_base="1.3"):
        cfg = compose("config", overrides=[trainer, f"trainer.default_root_dir={tmp_path}"])
    with _training_precision(cfg.trainer).train_step_context():
        assert torch.is_autocast_enabled("cpu") == (autocast is not None)
        assert autocast is None or torch.get_autocast_dtype("cpu") == autocast


def test_plan_module_plans_a_lightning_module_from_python():
    model = GPT(vocab=64, dim=32, n_layers=4, n_heads=2, seq_len=16)
    weights = {k: v.clone() for k, v in model.state_dict().items()}
    rows = plan_module(model, tokens(8, 16, 64), devices=4, machine=QUIET, schedules=["1f1b", "interleaved_1f1b"],
                       microbatches=[4, 8], activation_checkpointing=[False])  # fmt: skip
    assert {(p.config.schedule, p.config.pipeline_parallel_size) for p in rows} == {
        ("1f1b", 2), ("1f1b", 4), ("interleaved_1f1b", 2)}  # fmt: skip
    assert {p.config.data_parallel for p in rows if p.config.pipeline_parallel_size == 2} == {"ddp", "fsdp"}
    assert all(p.config.n_microbatches in (4, 8) for p in rows)
    # profiled, not trained: the module leaves as it came
    assert all(p.grad is None for p in model.parameters())
    assert all(torch.equal(v, weights[k]) for k, v in model.state_dict().items())


def test_runtime_costs_are_fitted_none_negative():
    # actions, messages, one step -> seconds: exact where the runs determine them
    rows = [[10, 4, 1], [40, 16, 1], [30, 40, 1]]
    truth = [2e-4, 5e-4, 3e-3]
    values = [sum(r * t for r, t in zip(row, truth)) for row in rows]
    assert fit_nonnegative(rows, values) == pytest.approx(truth)
    # a negative coefficient is fixed at zero and the rest refitted
    fitted = fit_nonnegative(rows, [v - 4e-4 * row[0] for v, row in zip(values, rows)])
    assert fitted[0] == 0.0 and min(fitted) >= 0


def test_zbv_leaves_nothing_between_steps_and_peaks_as_predicted(tmp_path, benchmark_costs):
    # benchmarks/memory.py's count, live, for the schedule whose split backward retains graphs: what the user's step
    # returned used to keep its graph (and what the input half retained) until the next step
    out = tmp_path / "memory.json"
    script = ROOT / "benchmarks/run_memory.py"
    code, output = run_script(script, 300, ranks=2, argv=["zbv", "8", "3", str(out)], cwd=tmp_path)
    assert code == 0, output[-3000:]
    measured = json.loads(out.read_text())
    config = Config(2, "zbv", 2, 8, (2, 2, 2, 2), "uniform", False)
    predicted = predict(config, benchmark_costs, QUIET, 32, 2).activation_bytes
    assert measured["peak_bytes_per_stage"] == pytest.approx(predicted, rel=0.10)
    # what is alive when a step starts: a few receive buffers and at times one micro-batch's activations (6.3 MB a
    # stage-micro-batch; 0 to 6.6 MB over runs, the base commit alike), not a step's (8 micro-batches, 2 stages)
    assert max(measured["held_bytes_per_stage"]) < 10e6
