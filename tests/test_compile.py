"""Compiled blocks under the pipeline: a user's own per-block ``torch.compile`` stays compiled, and ``compile=True``
compiles each held layer (pruned or traced); each trains as one process on the same micro-batches, compiled the
same way under inductor (dynamo's eager backend runs the captured operations unchanged: one process runs them
uncompiled)."""

from __future__ import annotations

import pytest
from conftest import ok, run_job
from models import HFLlama, loader
from test_frozen import _micro
from test_parity import common
from test_tied import assert_state_equal, combined

PARAM_TOL = 1e-5
EAGER = {"backend": "eager"}


def test_a_users_per_block_compile_stays_compiled_with_12_layers(tmp_path, reference):
    # block.compile() on each of 12 blocks (dynamo's eager backend: its guards and recompiles without inductor's
    # compile time): the placement's forward used to make dynamo recompile per layer and give up (recompile_limit 8)
    cfg = dict(model="block_compiled", schedule="1f1b", devices=2, m=2, batch=4, n_train=16, n_val=4, n_layers=12)
    job = ok(run_job({**cfg, "strategy": "pipeline"}, tmp_path / "job", timeout=300))
    assert "recompile_limit" not in job.output
    for rank in range(2):
        dynamo = job.rank(rank)["dynamo"]
        # one graph for training, one for validation's no-grad forward, serving all 6 blocks a rank holds
        assert dynamo["frames"]["ok"] == dynamo["frames"]["total"] and dynamo["stats"]["unique_graphs"] <= 2, dynamo
    assert_state_equal(job.state(), reference(**_micro(cfg))["state"], PARAM_TOL)
    losses = [r["train_loss"] for r in job.rank(0)["logged"] if "train_loss" in r]
    expected = [r["train_loss"] for r in reference(**common(cfg))["logged"] if "train_loss" in r]
    assert len(losses) == len(expected) > 0 and max(abs(a - b) for a, b in zip(losses, expected)) <= 2e-4


def test_auto_measures_blocks_the_user_compiled_and_trains_as_one_process(tmp_path, reference):
    # the profile's hooks run inside each compiled block: dynamo traced them, could not read a size off its fake
    # tensors and every rank stopped ("could not measure the model")
    cfg = dict(model="block_compiled", schedule="auto", devices=2, batch=8, n_train=16, n_val=4, n_layers=4)
    job = ok(run_job({**cfg, "strategy": "pipeline"}, tmp_path / "job", timeout=300))
    assert "recompile_limit" not in job.output and "schedule='auto' chose" in job.output
    for rank in range(2):
        dynamo = job.rank(rank)["dynamo"]
        assert dynamo["frames"]["ok"] == dynamo["frames"]["total"], dynamo
    m = job.rank(0)["chosen"]["n_microbatches"]
    assert_state_equal(job.state(), reference(**_micro({**cfg, "m": m}))["state"], PARAM_TOL)


@pytest.mark.parametrize(
    "schedule,compile,recompute,precision",
    [("1f1b", True, False, "bf16-mixed"), ("gpipe", EAGER, True, "16-mixed-cpu"), ("interleaved_1f1b", EAGER, False,
                                                                                     "32-true")],
    ids=["1f1b-inductor-bf16", "gpipe-recompute-fp16", "interleaved_1f1b"],
)  # fmt: skip
def test_compile_true_compiles_each_held_block_and_trains_as_one_process(schedule, compile, recompute, precision,
                                                                          tmp_path, reference):  # fmt: skip
    # 12 blocks; inductor under 1F1B with bf16 autocast (about 20 s of compile per rank here), dynamo's eager
    # backend for the others (the same frames, guards and graphs, no code generated), GPipe with fp16 autocast and
    # a loss scaler
    stages = 2 * (2 if schedule.startswith("interleaved") else 1)
    cfg = dict(schedule=schedule, devices=2, m=stages, batch=2 * stages, n_train=8 * stages, n_val=2 * stages,
               n_layers=12, compile=compile, activation_checkpointing=recompute, precision=precision)  # fmt: skip
    job = ok(run_job({**cfg, "strategy": "pipeline"}, tmp_path / "job", timeout=400))
    assert "recompile_limit" not in job.output
    for rank in range(2):
        dynamo = job.rank(rank)["dynamo"]
        assert dynamo["frames"]["ok"] == dynamo["frames"]["total"] > 0 and dynamo["stats"]["unique_graphs"] <= 2 * (
            stages // 2
        ), dynamo
    assert_state_equal(job.state(), reference(**_micro(cfg))["state"], PARAM_TOL)


@pytest.mark.parametrize("model", ["lora_moe", "lora_llama4"])
def test_compile_true_compiles_a_traced_models_layers(model, tmp_path, reference):
    # split="trace": the layers each traced piece calls are compiled (they were never reached: 0 graphs). A
    # Qwen3-MoE with LoRA on its experts' stacks (peft's target_parameters): peft registers a parametrization at
    # each call, which dynamo recompiled per layer until its limit and then ran eagerly (64 of 73 frames compiled);
    # Llama 4's experts, not transformers' experts kind, trace with the adapters' fold in the graph (a Llama's
    # attention beside them, as the plain Llama this test ran before)
    layers = "model.base_model.model.model.layers"
    cfg = dict(model=model, split="trace", layers=layers, schedule="1f1b", devices=2, m=2, batch=4, n_train=16,
               n_val=4, sanity=0, limit_val_batches=0, n_layers=4, compile=EAGER, blocks=layers, optimizer="sgd",
               lr=1.0)  # fmt: skip
    # lr 1: the experts' adapters moved well past the tolerance; no validation: its no-grad graphs are the other
    # tests' (the same frames again, a third of this test's time)
    job = ok(run_job({**cfg, "strategy": "pipeline"}, tmp_path / "job", timeout=300))
    for rank in range(2):
        dynamo = job.rank(rank)["dynamo"]
        assert dynamo["frames"]["ok"] == dynamo["frames"]["total"] > 0 and dynamo["stats"]["unique_graphs"] > 0, dynamo
    assert_state_equal(job.state(), reference(**_micro(cfg))["state"], PARAM_TOL)


def test_a_recompile_after_the_first_step_is_said_once_per_rank_with_its_reason(tmp_path):
    # 18 samples in batches of 4: the last batch of 2 has new shapes, which the compiled blocks compile again for
    cfg = dict(model="block_compiled", schedule="1f1b", devices=2, m=2, batch=4, n_train=18, n_val=4, n_layers=4)
    job = ok(run_job({**cfg, "strategy": "pipeline"}, tmp_path / "job", timeout=300))
    for rank in range(2):
        said = [line for line in job.output.splitlines() if line.startswith(f"Rank {rank}: after the first training")]
        assert len(said) == 1 and "1 more graph(s)" in said[0] and "size mismatch" in said[0], said


def test_a_new_sequence_length_every_batch_compiles_one_dynamic_graph(tmp_path, reference):
    # each batch cut to its own length (dynamic padding); compile={"dynamic": True}: one graph serves every length,
    # for training and for validation's no-grad forward (and, on the last stage, one for its first step's input,
    # which is a view: dynamo guards on its base), and PipelineMonitor's counters stay flat from the first step
    cfg = dict(schedule="1f1b", devices=2, m=2, batch=4, n_train=32, n_val=8, n_layers=4, vary=True,
               compile={**EAGER, "dynamic": True}, monitor_pipeline=True)  # fmt: skip
    assert len({batch["tokens"].shape[1] for batch in loader(32, 4, vary=True)}) >= 4
    job = ok(run_job({**cfg, "strategy": "pipeline"}, tmp_path / "job", timeout=300))
    assert "after the first training step" not in job.output
    for rank in range(2):
        dynamo = job.rank(rank)["dynamo"]
        assert dynamo["frames"]["ok"] == dynamo["frames"]["total"] > 0 and dynamo["stats"]["unique_graphs"] <= 2 + rank
    graphs = [r["pipeline/compiled_graphs"] for r in job.rank(0)["logged"] if "pipeline/compiled_graphs" in r]
    eager = [r["pipeline/eager_frames"] for r in job.rank(0)["logged"] if "pipeline/eager_frames" in r]
    assert len(graphs) == 7 and set(graphs) == {sum(job.rank(r)["dynamo"]["stats"]["unique_graphs"] for r in (0, 1))}
    assert set(eager) == {0}
    assert_state_equal(job.state(), reference(**common(cfg))["state"], PARAM_TOL)  # each batch cut as a whole


@pytest.mark.parametrize("inside", ["fsdp", "tp"])
def test_compile_true_with_fsdp_or_tensor_parallel_inside_stages(inside, tmp_path, reference):
    # 2 stages x 2 FSDP replicas (the blocks compiled after fully_shard: dynamo skips FSDP's hooks), or x 2
    # tensor-parallel shards of each block's MLP (DTensor parameters in the compiled graphs; SGD as in test_sharding)
    cfg = dict(schedule="1f1b", devices=4, pp=2, m=2, batch=4, n_train=16, n_val=4, n_layers=4, compile=EAGER)
    if inside == "fsdp":
        cfg.update(data_parallel="fsdp")
    else:
        cfg.update(model="tpinit", tp=2, build="init_module", optimizer="sgd", lr=0.5)
    job = ok(run_job({**cfg, "strategy": "pipeline"}, tmp_path / "job", timeout=400))
    for rank in range(4):
        dynamo = job.rank(rank)["dynamo"]
        assert dynamo["frames"]["ok"] == dynamo["frames"]["total"] > 0 and dynamo["stats"]["unique_graphs"] > 0, dynamo
    ref = reference(**(combined(cfg) if inside == "fsdp" else _micro(cfg)))
    assert_state_equal(job.state(), ref["state"], PARAM_TOL)


def test_layers_compiled_in_place_are_refused_under_split_trace_with_the_fix():
    # each rank's traced pieces call none of the model's modules: a Llama whose layers the user compiled ran eagerly
    # in the pipeline (no frame compiled) where one process ran them compiled
    from lightning_pp.errors import PipelineConfigError
    from lightning_pp.split.traced import Tracer

    module = HFLlama(n_layers=4)
    for layer in module.model.model.layers:
        layer.compile(backend="eager")
    said = r"model\.model\.layers\.0 \(and 3 more\) was compiled in place .*PipelineStrategy\(compile=True\)"
    with pytest.raises(PipelineConfigError, match=said):
        Tracer(module, "model", "model.model.layers", (2, 2))
