"""Checkpoints written under the pipeline load on one process and resume under any layout;
a rank that dies during a save leaves the previous checkpoint usable."""

from __future__ import annotations

import pytest
import torch
from conftest import consolidate_cli, ok, run_job
from models import TinyGPT
from test_errors import assert_all_ranks_gone
from test_parity import LOSS_TOL

from lightning_pp.checkpoints.swap import FAULT_ENV, NO_EXCHANGE_ENV
from lightning_pp.consolidate import consolidate

BASE = dict(batch=8, n_train=64, sanity=0, n_val=16, max_epochs=3)


def after(rows: list[dict], step: int) -> list[float]:
    return [r["train_loss"] for r in rows if "train_loss" in r and r["step"] >= step]


def test_full_checkpoint_resumes_under_another_stage_count_schedule_and_one_process(tmp_path, reference):
    first = ok(run_job({**BASE, "strategy": "pipeline", "devices": 2, "schedule": "1f1b", "m": 2, "max_steps": 4},
                       tmp_path / "first"))  # fmt: skip
    ckpt = first.out / "final.ckpt"
    assert torch.load(ckpt, weights_only=False)["global_step"] == 4
    one_process_first = reference(**BASE, max_steps=4)

    # compare resumed with resumed: the one-process run resumed from its own checkpoint at step 4
    expected = after(reference(**BASE, max_steps=8, resume=str(one_process_first["out"] / "final.ckpt"))["logged"], 4)
    assert len(expected) == 4

    three = ok(run_job({**BASE, "strategy": "pipeline", "devices": 3, "schedule": "gpipe", "m": 4, "max_steps": 8,
                        "resume": str(ckpt)}, tmp_path / "three"))  # fmt: skip
    one = reference(**BASE, max_steps=8, resume=str(ckpt))
    for got in (after(three.rank(0)["logged"], 4), after(one["logged"], 4)):
        assert len(got) == len(expected)
        assert max(abs(a - b) for a, b in zip(got, expected)) <= LOSS_TOL, (got, expected)
    # every rank of the resumed pipeline continued from the same state
    assert abs(three.rank(2)["train"][-1]["train_loss"] - expected[-1]) <= LOSS_TOL


def test_one_process_checkpoint_resumes_under_the_pipeline(tmp_path, reference):
    start = reference(**BASE, max_steps=4)
    expected = after(reference(**BASE, max_steps=8, resume=str(start["out"] / "final.ckpt"))["logged"], 4)
    job = ok(run_job({**BASE, "strategy": "pipeline", "devices": 2, "m": 2, "max_steps": 8,
                      "resume": str(start["out"] / "final.ckpt")}, tmp_path / "job"))  # fmt: skip
    got = after(job.rank(0)["logged"], 4)
    assert len(got) == 4 and max(abs(a - b) for a, b in zip(got, expected)) <= LOSS_TOL


@pytest.mark.parametrize(
    "state_dict_type,fault", [("full", "0:2:torn"), ("sharded", "1:2:written")], ids=["full-torn", "sharded-written"]
)
def test_a_rank_killed_during_a_save_leaves_the_previous_checkpoint(tmp_path, state_dict_type, fault):
    # rank 0 dies halfway through writing the file; rank 1 dies after writing its shards, before the rename
    job = run_job({**BASE, "strategy": "pipeline", "devices": 2, "m": 2, "save_every": 2, "max_steps": 8,
                   "timeout": 30, "env": {FAULT_ENV: fault}, "state_dict_type": state_dict_type},
                  tmp_path / "job", timeout=120)  # fmt: skip
    assert job.returncode != 0 and job.seconds < 60
    ckpts = job.out / "ckpts"
    assert not (ckpts / "step=4.ckpt").exists()  # the save rank 1 died in never landed
    previous = ckpts / "step=2.ckpt"
    if state_dict_type == "sharded":
        assert previous.is_dir()
        previous = consolidate(previous, tmp_path / "previous.ckpt")
    assert torch.load(previous, weights_only=False)["global_step"] == 2
    TinyGPT.load_from_checkpoint(previous)
    assert_all_ranks_gone(job.out, 2)


def test_a_swap_cut_between_its_renames_is_recovered_by_the_next_run(tmp_path, reference):
    # 3 ranks save a sharded last.ckpt every 2 steps where the swap takes two renames (as without renameat2);
    # rank 0 dies between them in the save that replaces step 2's last.ckpt with step 4's: nothing at the path
    cfg = {**BASE, "strategy": "pipeline", "devices": 3, "m": 3, "batch": 6, "n_train": 36, "save_every": 2,
           "save_last": True, "state_dict_type": "sharded", "timeout": 30}  # fmt: skip
    env = {FAULT_ENV: "0:4:swapped", NO_EXCHANGE_ENV: "1"}
    job = run_job({**cfg, "max_steps": 8, "env": env}, tmp_path / "job", timeout=120)
    ckpts = job.out / "ckpts"
    assert job.returncode != 0 and not (ckpts / "last.ckpt").exists(), job.output[-3000:]
    assert_all_ranks_gone(job.out, 3)
    # a fresh run resumes from the path: the newest complete checkpoint (step 4's), said so, then the next save
    # puts last.ckpt back and removes the leftovers
    resume = {**cfg, "max_steps": 10, "resume": str(ckpts / "last.ckpt")}
    again = ok(run_job({**resume, "devices": 2, "m": 2, "ckpt_dir": str(ckpts)}, tmp_path / "again"))
    assert "a save was interrupted while swapping it in. Loading the new checkpoint" in again.output
    step4 = consolidate(ckpts / "step=4.ckpt", tmp_path / "step4.ckpt")
    one = reference(**{**resume, "save_every": None, "resume": str(step4)})
    losses = after(again.rank(0)["logged"], 0)
    assert len(losses) == 6 and losses == pytest.approx(after(one["logged"], 0), abs=LOSS_TOL)
    assert (ckpts / "last.ckpt").is_dir() and [p.name for p in ckpts.iterdir() if p.name.startswith(".")] == []


def test_sharded_checkpoint_reshards_and_consolidates(tmp_path, reference):
    first = ok(run_job({**BASE, "strategy": "pipeline", "devices": 2, "schedule": "1f1b", "m": 2, "max_steps": 4,
                        "state_dict_type": "sharded"}, tmp_path / "first"))  # fmt: skip
    ckpt = first.out / "final.ckpt"
    assert ckpt.is_dir() and (ckpt / "meta.pt").is_file()
    assert sorted(p.name for p in ckpt.glob("*.distcp")) == ["__0_0.distcp", "__1_0.distcp"]  # one shard per rank
    start = reference(**BASE, max_steps=4)
    expected = after(reference(**BASE, max_steps=8, resume=str(start["out"] / "final.ckpt"))["logged"], 4)

    # resharded: 2 stages -> 3 stages, the other schedule
    three = ok(run_job({**BASE, "strategy": "pipeline", "devices": 3, "schedule": "gpipe", "m": 4, "max_steps": 8,
                        "resume": str(ckpt), "state_dict_type": "sharded"}, tmp_path / "three"))  # fmt: skip
    got = after(three.rank(0)["logged"], 4)
    assert len(got) == 4 and max(abs(a - b) for a, b in zip(got, expected)) <= LOSS_TOL

    # consolidated into one ordinary file: plain Lightning loads and resumes it on one process
    full = tmp_path / "full.ckpt"
    proc = consolidate_cli(ckpt, full)
    assert proc.returncode == 0, proc.stderr
    consolidated = torch.load(full, weights_only=False)
    assert set(consolidated["state_dict"]) == set(start["state"])
    assert [g["params"] for g in consolidated["optimizer_states"][0]["param_groups"]] == [
        g["params"] for g in start["optimizer"]["param_groups"]
    ]
    TinyGPT.load_from_checkpoint(full)
    one = reference(**BASE, max_steps=8, resume=str(full))
    got = after(one["logged"], 4)
    assert len(got) == 4 and max(abs(a - b) for a, b in zip(got, expected)) <= LOSS_TOL


def test_predict_returns_one_process_predictions_on_rank_zero_only(tmp_path, reference):
    cfg = dict(batch=8, n_train=32, n_val=20, val_batch=4, predict=True)
    job = ok(run_job({**cfg, "strategy": "pipeline", "devices": 3, "schedule": "gpipe", "m": 2}, tmp_path / "job"))
    ref = reference(**cfg)
    mine = torch.load(job.out / "predictions.pt", weights_only=False)
    theirs = torch.load(ref["out"] / "predictions.pt", weights_only=False)
    assert len(mine) == len(theirs) == 5  # one entry per batch, in batch order
    for a, b in zip(mine, theirs):
        assert a["batch_idx"] == b["batch_idx"] and torch.equal(a["tokens"], b["tokens"])
        assert torch.allclose(a["probs"], b["probs"], atol=1e-5, rtol=0)
    assert job.rank(0)["predictions_none"] is False
    assert job.rank(1)["predictions_none"] is True and job.rank(2)["predictions_none"] is True


def test_torchmetrics_logged_from_the_step_equal_one_process(tmp_path, reference):
    cfg = dict(batch=8, n_train=40, n_val=24, metrics=True, lr=3e-3)
    job = ok(run_job({**cfg, "strategy": "pipeline", "devices": 2, "schedule": "1f1b", "m": 4}, tmp_path / "job"))
    ref = reference(**cfg)

    def values(rows, key):
        return [r[key] for r in rows if key in r]

    for key in ("train_acc_step", "train_acc_epoch", "val_acc", "val_f1"):
        expected = values(ref["logged"], key)
        got = values(job.rank(0)["logged"], key)
        assert len(got) == len(expected) >= 1, key
        assert all(0 < v < 1 for v in expected), (key, expected)  # informative values, not 0 or 1
        assert max(abs(a - b) for a, b in zip(got, expected)) <= 1e-6, (key, got, expected)
    for rank in range(2):  # every rank's callbacks see the epoch values
        assert abs(job.rank(rank)["val"][-1]["val_acc"] - ref["val"][-1]["val_acc"]) <= 1e-6
