"""Every torch schedule, several stages per rank: the same losses, validation and parameters as one process."""

from __future__ import annotations

import pytest
from conftest import ok, run_job
from test_parity import LOSS_TOL, assert_exact_parameters, assert_same_logs, common
from test_tied import assert_state_equal

from lightning_pp.layout.schedule import V_SHAPED

MULTI_STAGE = ("interleaved_1f1b", "looped_bfs", "interleaved_zb", "zbv", "dualpipev")


@pytest.mark.parametrize("ranks", [1, 2, 4])
@pytest.mark.parametrize("schedule", MULTI_STAGE)
def test_multi_stage_schedule_matches_one_process(schedule, ranks, tmp_path, reference):
    # two stages per rank: 2 stages of one layer on one rank (adjacent stages on a rank: evaluation runs them in
    # forward order, torch 2.13 cannot run them forward-only), 4 on 2 ranks, 8 on 4; DualPipeV needs m >= stages
    m = 2 * ranks
    cfg = dict(schedule=schedule, devices=ranks, m=m, batch=8, n_train=32, n_val=16, n_layers=2 * ranks, params=True)
    job = ok(run_job({**cfg, "strategy": "pipeline"}, tmp_path / "job", timeout=300))
    ref = reference(**common(cfg))
    ranks_seen = [job.rank(r) for r in range(ranks)]
    assert_same_logs(ranks_seen[0], ref, LOSS_TOL)  # training and validation losses, step by step
    for seen in ranks_seen:
        assert [r["val_loss"] for r in seen["val"]] == pytest.approx([r["val_loss"] for r in ref["val"]], abs=LOSS_TOL)
    # the user's step ran where the last stage is: pipeline rank 0 for the V schedules, the last rank otherwise
    last = 0 if schedule in V_SHAPED else ranks - 1
    steps = len(ref["train"])
    assert [s["loss_steps"] for s in ranks_seen] == [steps * m if r == last else 0 for r in range(ranks)]
    assert_exact_parameters(job, cfg, reference, reversed_backward=schedule == "looped_bfs")


@pytest.mark.parametrize("schedule,order", [("1f1b", "gpipe"), ("dualpipev", "zbv")])
def test_batches_of_fewer_samples_than_stages_run_in_an_order_that_takes_them(schedule, order, tmp_path, reference):
    # the last training and validation batches hold one sample: 1F1B (2 stages) and DualPipeV (4) need a
    # micro-batch per stage, so those batches run in GPipe's and ZBV's order; they used to stop the fit at set-up
    cfg = dict(schedule=schedule, devices=2, batch=8, n_train=17, n_val=9, n_layers=4, optimizer="sgd", lr=0.5,
               max_epochs=2)  # fmt: skip
    job = ok(run_job({**cfg, "strategy": "pipeline"}, tmp_path / "job", timeout=300))
    assert (
        f"A training batch of 1 micro-batch(es) on {4 if order == 'zbv' else 2} stages runs in '{order}'" in job.output
    )
    ref = reference(**common(cfg))
    assert_same_logs(job.rank(0), ref, LOSS_TOL)  # every batch's loss, the one-sample ones included
    assert [r["val_loss"] for r in job.rank(1)["val"]] == pytest.approx(
        [r["val_loss"] for r in ref["val"]], abs=LOSS_TOL
    )
    assert_state_equal(job.state(), ref["state"], 1e-5)
