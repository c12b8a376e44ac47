"""A job torchrun restarts after a rank is killed comes back every time and ends where an uninterrupted
run ends: killed mid-epoch, inside an accumulation window, between a step's backward and its optimizer
step, during a save (full and sharded), under 1F1B and ZBV, with a loader Lightning can position."""

from __future__ import annotations

import torch
from conftest import ok, run_job
from test_parity import PARAM_TOL, common

from lightning_pp.checkpoints.swap import FAULT_ENV
from lightning_pp.consolidate import consolidate

# 6 batches an epoch, 2 epochs; a checkpoint (and last.ckpt) every 2 optimizer steps; every attempt resumes "last"
RESTARTS = dict(batch=8, n_train=48, max_epochs=2, sanity=0, save_every=2, save_last=True, resume="last",
                resumable=True, timeout=30, threads=1)  # fmt: skip


def assert_like_uninterrupted(job, cfg: dict, reference, tmp_path) -> None:
    """Every parameter equals one process's uninterrupted run on the same micro-batches (same sums, same order)."""
    final = job.out / "final.ckpt"
    if final.is_dir():
        final = consolidate(final, tmp_path / "final_full.ckpt")
    state = torch.load(final, weights_only=False)["state_dict"]
    restarts = (
        "save_every",
        "save_last",
        "resume",
        "resumable",
        "kills",
        "attempt_env",
        "state_dict_type",
        "async_save",
    )
    plain = {k: v for k, v in common(cfg).items() if k not in restarts}
    one = reference(**{**plain, "batch": cfg["batch"] // cfg["m"], "accumulate": cfg["m"] * cfg.get("accumulate", 1)})
    assert set(state) == set(one["state"])
    for key, value in one["state"].items():
        assert torch.allclose(state[key], value, atol=PARAM_TOL, rtol=0), (key, (state[key] - value).abs().max())


def test_1f1b_full_checkpoints_come_back_from_five_kills(tmp_path, reference):
    # attempt 0: rank 1 dies inside an accumulation window, mid-epoch (resumes from step 2)
    # attempt 1: rank 0 dies halfway through writing step 4's checkpoint (resumes from step 2 again)
    # attempt 2: rank 1 dies after a backward, before its optimizer step, in the second epoch (resumes from step 4)
    # attempts 3 and 4: killed before step 6, again from step 4: a resumed attempt must not checkpoint step 4 a
    # second time after its first batch (mid-window: Lightning's ModelCheckpoint would), or this attempt skips one
    # shuffled by a DistributedSampler: an epoch resumed mid-way must be drawn in its own order, not epoch 0's
    kills = {"0": [1, 5, "start"], "2": [1, 9, "step"], "3": [0, 10, "start"], "4": [1, 11, "step"]}
    cfg = {**RESTARTS, "strategy": "pipeline", "schedule": "1f1b", "devices": 2, "m": 2, "accumulate": 2,
           "shuffle": True, "kills": kills, "attempt_env": {"1": {FAULT_ENV: "0:1:torn"}}}  # fmt: skip
    job = ok(run_job(cfg, tmp_path / "job", timeout=400, restarts=5))
    assert sorted(p.name for p in job.out.glob("attempt*")) == [f"attempt{a}_rank{r}" for a in range(6) for r in (0, 1)]
    assert_like_uninterrupted(job, cfg, reference, tmp_path)


def test_zbv_async_sharded_checkpoints_come_back_from_three_kills(tmp_path, reference):
    # saves in the background (async_save): each completes at the next save, or at the end of fit
    # attempt 0: rank 0 dies before the fourth batch (resumes from step 2)
    # attempt 1: rank 1 dies while its shards of step 4's checkpoint are being written (resumes from step 2 again)
    # attempt 2: rank 1 dies with step 8's save in flight: resumes from step 6's, written on the epoch's last batch
    # (where Lightning would run the finished epoch again on the exhausted loader and lose the next one)
    cfg = {**RESTARTS, "strategy": "pipeline", "schedule": "zbv", "devices": 2, "m": 4, "state_dict_type": "sharded",
           "async_save": True, "kills": {"0": [0, 3, "start"], "2": [1, 9, "start"]},
           "attempt_env": {"1": {FAULT_ENV: "1:1:staged"}}}  # fmt: skip
    job = ok(run_job(cfg, tmp_path / "job", timeout=400, restarts=3))
    assert sorted(p.name for p in job.out.glob("attempt*")) == [f"attempt{a}_rank{r}" for a in range(4) for r in (0, 1)]
    assert (job.out / "ckpts" / "last.ckpt").is_dir()
    assert_like_uninterrupted(job, cfg, reference, tmp_path)
