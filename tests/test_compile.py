"""Compiled blocks under the pipeline: a user's own per-block ``torch.compile`` stays compiled and trains as one
process compiled the same way."""

from __future__ import annotations

from conftest import ok, run_job
from test_frozen import _micro
from test_parity import common
from test_tied import assert_state_equal

PARAM_TOL = 1e-5


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
