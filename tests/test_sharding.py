"""Sharded replicas (FSDP2 inside every stage) and tensor parallelism train as one process on the whole batch."""

from __future__ import annotations

import torch
from conftest import ok, run_job
from test_parity import LOSS_TOL, assert_same_logs, common
from test_tied import assert_state_equal, combined

from lightning_pp.checkpoint import load_sharded

PARAM_TOL = 1e-5
FSDP = dict(devices=4, pp=2, data_parallel="fsdp", batch=8, n_train=64, n_val=16, sync_dist=True, max_steps=6)


def test_fsdp_1f1b_with_clipping_and_adamw_trains_as_one_process(tmp_path, reference):
    cfg = dict(FSDP, schedule="1f1b", m=2, clip=0.05)
    job = ok(run_job({**cfg, "strategy": "pipeline"}, tmp_path / "job"))
    ref = reference(**combined(cfg))
    for rank in range(4):
        assert abs(job.rank(rank)["train"][-1]["train_loss"] - ref["train"][-1]["train_loss"]) <= LOSS_TOL
    assert_same_logs(job.rank(0), ref, LOSS_TOL)
    assert_state_equal(job.state(), ref["state"], PARAM_TOL)
