"""Replicas of the pipeline (data x pipeline parallel) train as Lightning's DDP does."""

from __future__ import annotations

import pytest
import torch
from conftest import ok, run_job

from lightning_pp.layout.mesh import Layout, make_layout

TOL, PARAM_TOL = 2e-4, 1e-6
COMMON = dict(batch=8, n_train=64, n_val=32, sync_dist=True, max_steps=6, max_epochs=3, sanity=0)


def sync_losses(rows: list[dict], key: str) -> list[float]:
    return [r[key] for r in rows if key in r]


def test_layout_keeps_each_pipeline_on_consecutive_ranks():
    layout = make_layout(2, 8, 5)
    assert (layout.dp, layout.pp_rank, layout.replica, layout.last_stage_rank) == (4, 1, 2, 5)
    assert layout.pipeline_ranks(2) == [4, 5] and layout.replica_ranks(1) == [1, 3, 5, 7]
    assert "replica 1: rank 2 (node 0) -> rank 3 (node 0)" in Layout(8, 2, 0).describe(devices_per_node=4)


@pytest.fixture(scope="module")
def ddp(tmp_path_factory):
    """Lightning's DDP on 2 processes: what 2 replicas of the pipeline must log."""
    return ok(run_job({**COMMON, "strategy": "ddp", "devices": 2}, tmp_path_factory.mktemp("ddp") / "job"))


def test_two_replicas_of_two_stages_train_as_ddp(tmp_path, ddp, reference):
    pipe = ok(run_job({**COMMON, "strategy": "pipeline", "devices": 4, "pp": 2, "m": 2}, tmp_path / "pipe"))
    for key in ("train_loss", "val_loss"):
        expected, got = sync_losses(ddp.rank(0)["logged"], key), sync_losses(pipe.rank(0)["logged"], key)
        assert len(got) == len(expected) >= 1
        assert max(abs(a - b) for a, b in zip(got, expected)) <= TOL, (key, got, expected)
    for rank in range(4):  # every rank of both replicas sees the replica-averaged values
        assert abs(pipe.rank(rank)["train"][-1]["train_loss"] - ddp.rank(0)["train"][-1]["train_loss"]) <= TOL

    # parameters: DDP fed the same micro-batches (batch B/m, accumulating m)
    micro = ok(run_job({**COMMON, "strategy": "ddp", "devices": 2, "batch": 4, "accumulate": 2}, tmp_path / "micro"))
    mine, theirs = pipe.state(), micro.state()
    assert set(mine) == set(theirs)
    worst = max((mine[k] - theirs[k]).abs().max().item() for k in theirs)
    assert worst <= PARAM_TOL, worst
    initial = torch.load(pipe.out / "initial.pt")
    for key in ("net.embed.weight", "net.blocks.b0.ff.0.weight", "net.blocks.b3.ff.2.weight", "net.head.weight"):
        assert (mine[key] - initial[key]).abs().max().item() > 100 * PARAM_TOL

    # the checkpoint of 2 replicas x 2 stages resumes on 1 replica x 2 stages and on one process alike
    resume = {**COMMON, "sync_dist": False, "max_steps": 10, "resume": str(pipe.out / "final.ckpt")}
    one_pipeline = ok(run_job({**resume, "strategy": "pipeline", "devices": 2, "m": 2}, tmp_path / "r12"))
    a = sync_losses(one_pipeline.rank(0)["logged"], "train_loss")
    b = sync_losses(reference(**resume)["logged"], "train_loss")
    assert len(a) == len(b) == 4 and max(abs(x - y) for x, y in zip(a, b)) <= TOL


def test_two_replicas_of_a_v_schedule_across_two_loopback_nodes(tmp_path, ddp):
    # ZBV: each replica's last stage, loss and logs sit on its first rank (global ranks 0 and 2)
    zbv = {**COMMON, "strategy": "pipeline", "schedule": "zbv", "pp": 2, "m": 4}
    # the ranks forked with the environment torchrun gives 2 nodes of 2 (the app's loopback test runs torchrun's
    # own rendezvous across two agents)
    job = ok(run_job({**zbv, "devices": 2, "num_nodes": 2}, tmp_path / "two"))
    ranks = [job.rank(r) for r in range(4)]
    assert [(r["node_rank"], r["local_rank"]) for r in ranks] == [(0, 0), (0, 1), (1, 0), (1, 1)]
    got = sync_losses(ranks[0]["logged"], "train_loss")
    reference = sync_losses(ddp.rank(0)["logged"], "train_loss")
    assert len(reference) == len(got) and max(abs(a - b) for a, b in zip(reference, got)) <= TOL
    assert [rank["loss_steps"] > 0 for rank in ranks] == [True, False, True, False]


def test_a_sampler_that_ignores_the_replica_fails_on_every_rank(tmp_path):
    job = run_job({**COMMON, "strategy": "pipeline", "devices": 2, "m": 2, "bad_sampler": True, "timeout": 30},
                  tmp_path / "job", timeout=120)  # fmt: skip
    assert job.returncode != 0 and job.seconds < 60
    assert job.output.count("The stages of one pipeline received different batches") >= 2, job.output[-3000:]
