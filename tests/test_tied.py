"""A tied embedding and head (one Parameter on the first and the last stage) trains as one process trains it,
under every kind of schedule: stages on two ranks (1F1B, interleaved), both on one rank (ZBV, DualPipeV),
with replicas, clipping, a meta build, both checkpoint formats and a resume under another layout."""

from __future__ import annotations

import pytest
import torch
from conftest import ok, run_job
from job import TiedGPT
from test_parity import LOSS_TOL, PARAM_TOL, assert_exact_parameters, assert_same_logs, common

from lightning_pp.checkpoints.formats import load_sharded

TIED = dict(model="tied", optimizer="sgd", lr=0.5, clip=0.05, batch=8, n_train=32, n_val=16)
REPLICAS = dict(TIED, devices=4, pp=2, sync_dist=True, n_train=64, max_steps=6)


def combined(cfg: dict) -> dict:
    """One process drawing what 2 replicas draw together: their combined batch, in the distributed sampler's order
    (the mean over both replicas' batches is the mean over the combined one)."""
    return {**common(cfg), "batch": 2 * cfg["batch"], "replicas_order": True}


def assert_tied(state: dict[str, torch.Tensor]) -> None:
    """The copies the first and the last stage hold are bit-identical (checkpoints gather each from its stage)."""
    assert torch.equal(state["net.embed.weight"], state["net.head.weight"])


def assert_state_equal(state: dict[str, torch.Tensor], ref: dict[str, torch.Tensor], tol: float) -> None:
    assert state.keys() == ref.keys()
    worst = {k: (state[k] - v).abs().max().item() for k, v in ref.items()}
    assert max(worst.values()) <= tol, sorted(worst.items(), key=lambda kv: -kv[1])[:3]


def assert_one_optimizer_entry(optimizer: dict, ref: dict) -> None:
    assert [g["params"] for g in optimizer["param_groups"]] == [g["params"] for g in ref["param_groups"]]
    assert sorted(optimizer["state"]) == sorted(ref["state"])  # the tied tensor once, as in one process


@pytest.mark.parametrize(
    "schedule,m", [("interleaved_1f1b", 4), ("dualpipev", 4)], ids=["interleaved-ranks-0-1", "dualpipev-rank-0"]
)
def test_tied_weights_on_two_ranks_match_one_process(schedule, m, tmp_path, reference):
    # interleaved: stages 0 and 3 on ranks 0 and 1 (summed over both); DualPipeV: both on rank 0 (a stand-in)
    cfg = dict(TIED, schedule=schedule, devices=2, m=m)
    job = ok(run_job({**cfg, "strategy": "pipeline"}, tmp_path / "job"))
    assert_same_logs(job.rank(0), reference(**common(cfg)), LOSS_TOL)
    assert_tied(job.state())
    assert_exact_parameters(job, cfg, reference)


def test_tied_weights_built_on_meta_with_replicas_then_resumed_under_a_v_schedule(tmp_path, reference):
    # 1F1B, replicas (DDP drives the replicas' average); the weights built on meta start from one process's
    cfg = dict(REPLICAS, schedule="1f1b", m=2, build="init_module")
    job = ok(run_job({**cfg, "strategy": "pipeline"}, tmp_path / "job"))
    ref = reference(**combined(cfg))
    assert_same_logs(job.rank(0), ref, LOSS_TOL)
    assert_tied(job.state())
    assert_state_equal(job.state(), ref["state"], PARAM_TOL)
    ckpt = torch.load(job.out / "final.ckpt", weights_only=False)
    assert_one_optimizer_entry(ckpt["optimizer_states"][0], ref["optimizer"])
    plain = TiedGPT.load_from_checkpoint(job.out / "final.ckpt")  # the full checkpoint in the plain module
    assert plain.net.head.weight is plain.net.embed.weight
    assert torch.allclose(plain.net.head.weight, ref["state"]["net.head.weight"], atol=PARAM_TOL, rtol=0)

    # resumed by ZBV on 2 ranks (both copies on rank 0) and by one process, from that checkpoint
    resume = dict(TIED, schedule="zbv", m=4, max_steps=12, max_epochs=4, resume=str(job.out / "final.ckpt"))
    zbv = ok(run_job({**resume, "strategy": "pipeline", "devices": 2}, tmp_path / "zbv"))
    assert_same_logs(zbv.rank(0), reference(**common(resume)), LOSS_TOL)
    assert_tied(zbv.state())


def test_tied_weights_under_zbv_with_replicas_save_sharded_as_one_process(tmp_path, reference):
    # ZBV's split backward with replicas (the runner averages them) and a sharded checkpoint
    cfg = dict(REPLICAS, schedule="zbv", m=4, state_dict_type="sharded")
    job = ok(run_job({**cfg, "strategy": "pipeline"}, tmp_path / "job"))
    ref = reference(**combined(cfg))
    assert_same_logs(job.rank(0), ref, LOSS_TOL)
    ckpt = load_sharded(job.out / "final.ckpt")
    assert_tied(ckpt["state_dict"])
    assert_state_equal(ckpt["state_dict"], ref["state"], PARAM_TOL)
    assert_one_optimizer_entry(ckpt["optimizer_states"][0], ref["optimizer"])
