"""Compiled blocks under the pipeline: a user's own per-block ``torch.compile`` stays compiled, and ``compile=True``
compiles each held layer (pruned or traced); each trains as one process compiled the same way on the same
micro-batches."""

from __future__ import annotations

import pytest
from conftest import ok, run_job
from test_frozen import _micro
from test_parity import common
from test_tied import assert_state_equal

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


@pytest.mark.parametrize(
    "schedule,compile,recompute",
    [("1f1b", True, False), ("gpipe", EAGER, True), ("interleaved_1f1b", EAGER, False)],
    ids=["1f1b-inductor", "gpipe-recompute", "interleaved_1f1b"],
)
def test_compile_true_compiles_each_held_block_and_trains_as_one_process(schedule, compile, recompute, tmp_path,
                                                                          reference):  # fmt: skip
    # 12 blocks; inductor under 1F1B (about 20 s of compile per rank here), dynamo's eager backend for the others
    # (the same frames, guards and graphs, no code generated)
    stages = 2 * (2 if schedule.startswith("interleaved") else 1)
    cfg = dict(schedule=schedule, devices=2, m=stages, batch=2 * stages, n_train=8 * stages, n_val=2 * stages,
               n_layers=12, compile=compile, activation_checkpointing=recompute)  # fmt: skip
    job = ok(run_job({**cfg, "strategy": "pipeline"}, tmp_path / "job", timeout=400))
    assert "recompile_limit" not in job.output
    for rank in range(2):
        dynamo = job.rank(rank)["dynamo"]
        assert dynamo["frames"]["ok"] == dynamo["frames"]["total"] > 0 and dynamo["stats"]["unique_graphs"] <= 2 * (
            stages // 2
        ), dynamo
    assert_state_equal(job.state(), reference(**_micro(cfg))["state"], PARAM_TOL)


def test_compile_true_compiles_a_traced_llama_s_layers(tmp_path, reference):
    # split="trace": the layers each traced piece calls are compiled (they were never reached: 0 graphs)
    cfg = dict(model="llama", split="trace", layers="model.model.layers", schedule="1f1b", devices=2, m=2, batch=4,
               n_train=16, n_val=4, n_layers=4, compile=EAGER, blocks="model.model.layers",
               optimizer="sgd")  # fmt: skip
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
