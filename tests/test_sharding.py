"""Sharded replicas (FSDP2 inside every stage) and tensor parallelism train as one process on the whole batch."""

from __future__ import annotations

import pytest
import torch
from conftest import ok, run_job
from models import TinyGPT
from test_parity import LOSS_TOL, assert_same_logs, common
from test_tied import assert_state_equal, assert_tied, combined

from lightning_pp.checkpoints.formats import load_sharded
from lightning_pp.consolidate import consolidate

PARAM_TOL = 1e-5
FSDP = dict(
    devices=4, pp=2, data_parallel="fsdp", batch=8, n_train=64, n_val=16, sync_dist=True, max_steps=6, max_epochs=3
)


def test_fsdp_1f1b_with_clipping_and_adamw_trains_as_one_process(tmp_path, reference):
    cfg = dict(FSDP, schedule="1f1b", m=2, clip=0.05)
    job = ok(run_job({**cfg, "strategy": "pipeline"}, tmp_path / "job"))
    ref = reference(**combined(cfg))
    for rank in range(4):
        assert abs(job.rank(rank)["train"][-1]["train_loss"] - ref["train"][-1]["train_loss"]) <= LOSS_TOL
    assert_same_logs(job.rank(0), ref, LOSS_TOL)
    assert_state_equal(job.state(), ref["state"], PARAM_TOL)
    plain = TinyGPT.load_from_checkpoint(job.out / "final.ckpt")  # the full checkpoint in the plain module
    assert torch.equal(plain.net.head.weight, ref["state"]["net.head.weight"].to(plain.device)) or torch.allclose(
        plain.net.head.weight, ref["state"]["net.head.weight"], atol=PARAM_TOL, rtol=0
    )

    # that file resumed by interleaved 1F1B (4 stages on 2 ranks, 2 replicas, sharded) and by one process
    resume = dict(cfg, schedule="interleaved_1f1b", m=4, max_steps=11, max_epochs=5, resume=str(job.out / "final.ckpt"))
    again = ok(run_job({**resume, "strategy": "pipeline"}, tmp_path / "again"))
    assert_same_logs(again.rank(0), reference(**combined(resume)), LOSS_TOL)


def test_fsdp_gpipe_microbatch_reshard_with_accumulation_trains_as_one_process(tmp_path, reference):
    cfg = dict(
        FSDP,
        schedule="gpipe",
        m=4,
        fsdp_reshard="microbatch",
        accumulate=2,
        max_steps=4,
        build="init_module",
        model="init",
    )
    job = ok(run_job({**cfg, "strategy": "pipeline"}, tmp_path / "job"))
    ref = reference(**combined(cfg))
    assert_same_logs(job.rank(0), ref, LOSS_TOL)
    assert_state_equal(job.state(), ref["state"], PARAM_TOL)
    whole = job.rank(0)["whole_bytes"]
    for rank in range(4):  # each rank holds half of its stage
        assert job.rank(rank)["local_param_bytes"] <= 0.3 * whole, (rank, job.rank(rank)["local_param_bytes"], whole)


def test_fsdp_zbv_with_validation_saves_a_sharded_checkpoint_that_resumes_under_ddp(tmp_path, reference):
    # each layer recomputed once per micro-batch although ZBV's backward runs an input and a weight pass
    cfg = dict(FSDP, schedule="zbv", m=4, state_dict_type="sharded", val_check_interval=0.5, test=True,
               activation_checkpointing=True)  # fmt: skip
    job = ok(run_job({**cfg, "strategy": "pipeline"}, tmp_path / "job"))
    ref = reference(**combined(cfg))
    assert_same_logs(job.rank(0), ref, LOSS_TOL)
    ckpt = load_sharded(job.out / "final.ckpt")
    assert_state_equal(ckpt["state_dict"], ref["state"], PARAM_TOL)
    for rank in range(4):
        assert abs(job.rank(rank)["validate"]["val_loss"] - ref["validate"]["val_loss"]) <= LOSS_TOL

    # resumed from that directory by 1F1B on 3 ranks without replicas, and by one process from its consolidation
    resume = dict(common(cfg), sync_dist=False, max_steps=10, test=False)
    three = ok(run_job({**resume, "resume": str(job.out / "final.ckpt"), "strategy": "pipeline", "devices": 3, "m": 4},
                       tmp_path / "three"))  # fmt: skip
    whole = consolidate(job.out / "final.ckpt", tmp_path / "whole.ckpt")
    assert_same_logs(three.rank(0), reference(**resume, resume=str(whole)), LOSS_TOL)


def test_tensor_parallel_plan_in_configure_model_trains_as_one_process(tmp_path, reference):
    # pp=2 x tp=2: each block's MLP split column-wise then row-wise over the shards, built on meta (SGD: Adam would
    # amplify the shards' other summation order to ~1e-5 in 5 steps)
    cfg = dict(model="tpinit", devices=4, pp=2, tp=2, schedule="1f1b", m=2, batch=8, n_train=48, n_val=16, max_steps=5,
               clip=0.05, build="init_module", state_dict_type="sharded", optimizer="sgd", lr=0.5,
               predict=True)  # fmt: skip
    job = ok(run_job({**cfg, "strategy": "pipeline"}, tmp_path / "job"))
    ref = reference(**common(cfg))
    for rank in range(4):
        assert abs(job.rank(rank)["train"][-1]["train_loss"] - ref["train"][-1]["train_loss"]) <= LOSS_TOL
    assert_same_logs(job.rank(0), ref, LOSS_TOL)
    ckpt = load_sharded(job.out / "final.ckpt")
    assert_state_equal(ckpt["state_dict"], ref["state"], PARAM_TOL)
    # each shard holds half of every MLP matrix
    assert job.rank(0)["local_param_bytes"] < job.rank(0)["param_bytes"] * 0.8
    # predictions on global rank 0 only, as one process's
    mine = torch.load(job.out / "predictions.pt", weights_only=False)
    theirs = torch.load(ref["out"] / "predictions.pt", weights_only=False)
    assert len(mine) == len(theirs) == 2
    for a, b in zip(mine, theirs):
        assert torch.equal(a["tokens"], b["tokens"]) and torch.allclose(a["probs"], b["probs"], atol=1e-5, rtol=0)
    assert [job.rank(r)["predictions_none"] for r in range(4)] == [False, True, True, True]


def test_fsdp_over_tensor_parallel_stages_trains_as_one_process(tmp_path, reference):
    # dp=2 x pp=2 x tp=2 on 8 ranks: FSDP shards the tensor-parallel slices over the replicas (2-D DTensors)
    cfg = dict(model="tpinit", build="init_module", devices=8, pp=2, tp=2, data_parallel="fsdp", m=2, batch=8,
               n_train=64, n_val=16, max_steps=4, max_epochs=3, clip=0.05, optimizer="sgd", lr=0.5,
               sync_dist=True)  # fmt: skip
    job = ok(run_job({**cfg, "strategy": "pipeline"}, tmp_path / "job"))
    ref = reference(**combined(cfg))
    assert_same_logs(job.rank(0), ref, LOSS_TOL)
    assert_state_equal(job.state(), ref["state"], PARAM_TOL)
    assert job.rank(7)["local_param_bytes"] < 0.4 * job.rank(7)["param_bytes"]


def test_fully_shard_in_configure_model_and_a_missing_plan_are_reported_on_every_rank(tmp_path):
    base = dict(devices=4, pp=2, m=2, batch=8, n_train=16, max_steps=1, sanity=0, timeout=30)
    job = run_job({**base, "model": "self_sharded", "data_parallel": "fsdp", "strategy": "pipeline"}, tmp_path / "a")
    assert job.returncode != 0 and job.seconds < 60
    assert job.output.count("has modules already sharded with fully_shard: ['net.blocks.b0'") == 4, job.output[-3000:]
    # tensor_parallel_size=2 but configure_model applied no plan: said once, and the run still trains
    plain = ok(run_job({**base, "tp": 2, "strategy": "pipeline"}, tmp_path / "b"))
    assert plain.output.count("its configure_model applied no plan") == 1, plain.output[-3000:]


def test_fsdp_under_bf16_mixed_and_fp16_with_its_scaler_match_one_process(tmp_path, reference):
    # bf16-mixed: FSDP all-gathers bf16 and reduces fp32 (MixedPrecisionPolicy), autocast computes in bf16
    cfg = dict(FSDP, schedule="1f1b", m=2, precision="bf16-mixed", max_steps=4)
    job = ok(run_job({**cfg, "strategy": "pipeline"}, tmp_path / "bf16"))
    assert_same_logs(job.rank(0), reference(**combined(cfg)), 2e-2)
    # 16-mixed with a CPU GradScaler: the sharded gradients unscaled, one verdict, the scale as one process's
    cfg = dict(FSDP, schedule="gpipe", m=2, precision="16-mixed-cpu", max_steps=5, init_scale=2.0**20)
    job = ok(run_job({**cfg, "strategy": "pipeline"}, tmp_path / "fp16"))
    ref = reference(**combined(cfg))
    assert_same_logs(job.rank(0), ref, 1e-2)
    for rank in range(4):
        assert job.rank(rank)["scales"] == ref["scales"] and job.rank(rank)["moved"] == ref["moved"]


@pytest.mark.parametrize(
    "schedule,extra", [("1f1b", {}), ("zbv", {"build": "init_module", "state_dict_type": "sharded"})],
    ids=["1f1b-two-ranks", "zbv-one-rank-meta-sharded"],
)  # fmt: skip
def test_fsdp_with_a_tied_embedding_and_torchmetrics_trains_as_one_process(schedule, extra, tmp_path, reference):
    # 1F1B: the tied tensor sharded alike on the first and the last stage's ranks; ZBV: both stages on one rank,
    # each its own FSDP root (a stand-in refreshed from the tensor). Metrics sync over the replicas.
    cfg = dict(FSDP, model="tied", optimizer="sgd", lr=0.5, clip=0.05, schedule=schedule, m=4, metrics=True, **extra)
    job = ok(run_job({**cfg, "strategy": "pipeline"}, tmp_path / "job"))
    ref = reference(**combined(cfg))
    assert_same_logs(job.rank(0), ref, LOSS_TOL)
    state = load_sharded(job.out / "final.ckpt")["state_dict"] if "state_dict_type" in cfg else job.state()
    assert_state_equal(state, ref["state"], PARAM_TOL)
    assert_tied(state)
    for key in ("train_acc_epoch", "val_acc", "val_f1"):  # computed over both replicas, as one process on both
        expected = [r[key] for r in ref["logged"] if key in r]
        got = [r[key] for r in job.rank(0)["logged"] if key in r]
        assert len(got) == len(expected) >= 1 and max(abs(a - b) for a, b in zip(got, expected)) <= 1e-6, key
