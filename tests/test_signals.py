"""A signal that reaches any rank stops every rank at the same step, promptly, with the signal's exit status and the
last checkpoint whole; SLURM's requeue signal saves a checkpoint that resumes exactly; a steady step makes no
collective. Signals are sent mid-step from a thread of the rank's own process, as a scheduler's would arrive."""

from __future__ import annotations

import json

import pytest
import torch
from conftest import ok, run_job
from job import process_running
from test_restarts import RESTARTS, assert_like_uninterrupted

from lightning_pp.consolidate import consolidate

SIGNALLED = dict(m=2, batch=8, n_train=400, max_epochs=1, sanity=0, timeout=60, threads=1, save_every=2,
                 save_last=True)  # fmt: skip
CASES = {
    # rank 0 waits in a receive from the rank that got the signal: released by that rank running on to the same step
    "1f1b, the last stage": dict(schedule="1f1b", devices=2, signals=[[1, 5, "TERM"]]),
    "1f1b, rank 0 (the store's host)": dict(schedule="1f1b", devices=2, signals=[[0, 5, "TERM"]]),
    "zbv, the last rank, async sharded saves": dict(schedule="zbv", devices=2, m=4, signals=[[1, 5, "TERM"]],
                                                    state_dict_type="sharded", async_save=True),
    "zbv, SIGINT to rank 0": dict(schedule="zbv", devices=2, m=4, signals=[[0, 4, "INT"]]),
    "1f1b, the middle stage of 3": dict(schedule="1f1b", devices=3, m=4, signals=[[1, 5, "TERM"]]),
    "gpipe, every rank (the whole job preempted)": dict(schedule="gpipe", devices=2,
                                                         signals=[[0, 5, "TERM"], [1, 5, "TERM"]]),
    "1f1b, 2 replicas x 2 stages, one replica's last stage": dict(schedule="1f1b", devices=4, pp=2,
                                                                   signals=[[3, 5, "TERM"]]),
    # a long validation inside fit: every rank stops after the same validation batch, not at its end
    "1f1b, rank 0 during validation": dict(schedule="1f1b", devices=2, n_train=80, n_val=800, pace=0.02,
                                            signals=[[0, 3, "TERM", "val"]]),
    # as a user starts it: one process, whose Lightning launcher starts the other rank (and watches it)
    "1f1b, launched by Lightning, the last stage": dict(schedule="1f1b", devices=2, signals=[[1, 5, "TERM"]],
                                                         launcher=True),
}  # fmt: skip


def stops(job, world: int) -> list[dict]:
    return [json.loads((job.out / f"stopped{r}.json").read_text()) for r in range(world)]


@pytest.mark.parametrize("case", list(CASES))
def test_a_signal_to_any_rank_stops_every_rank_at_one_step(tmp_path, case):
    cfg = {"strategy": "pipeline", **SIGNALLED, **CASES[case]}
    job = run_job(cfg, tmp_path / "job", timeout=180, launcher=cfg.pop("launcher", False))
    signum = 2 if cfg["signals"][0][2] == "INT" else 15
    assert set(job.codes) == {128 + signum}, job.output[-3000:]  # launched by Lightning: its first process's
    assert not any(process_running(int((job.out / f"pid{r}").read_text())) for r in range(cfg["devices"]))
    where = stops(job, cfg["devices"])
    assert len({(w["step"], w["batches"], w["val_batches"]) for w in where}) == 1, where  # after the same step
    assert all(w["exception"] == "SignalStop" and w["received_sigterm"] for w in where), where
    signalled = min(float((job.out / f"signalled{r}").read_text()) for r, *_ in cfg["signals"])
    assert max(w["time"] for w in where) - signalled < 30
    assert where[0]["step"] < 40 and where[0]["val_batches"] < 50  # stopped, not trained or validated to the end
    last = job.out / "ckpts" / "last.ckpt"  # whole: it loads, at the newest save before the stop
    full = consolidate(last, tmp_path / "last_full.ckpt") if last.is_dir() else last
    saved = torch.load(full, weights_only=False, map_location="cpu")
    assert saved["global_step"] == where[0]["step"] - where[0]["step"] % 2


def test_slurm_requeue_signal_saves_a_checkpoint_that_resumes_exactly(tmp_path, reference):
    # SIGUSR1 reaches rank 1 in batch 3: every rank saves Lightning's hpc checkpoint at the same step and trains on;
    # SLURM's SIGTERM follows in batch 7 (to rank 0). The requeued job resumes from the hpc checkpoint by itself.
    cfg = {**RESTARTS, "strategy": "pipeline", "schedule": "1f1b", "devices": 2, "m": 2, "accumulate": 2,
           "shuffle": True, "slurm": True, "save_every": None, "resume": None}  # fmt: skip
    signals = {"signals": [[1, 3, "USR1"], [0, 7, "TERM"]], "pace": 0.3}  # steps long enough for the news to arrive
    first = run_job({**cfg, **signals}, tmp_path / "first", timeout=180)
    assert first.codes == [143, 143], first.output[-3000:]
    hpc = tmp_path / "hpc_ckpt_1.ckpt"
    assert hpc.exists() and not (tmp_path / "hpc_ckpt_2.ckpt").exists()
    assert torch.load(hpc, weights_only=False)["global_step"] in (2, 3)  # saved at the same step on every rank
    job = ok(run_job(cfg, tmp_path / "job", timeout=180))
    assert "Restoring states from the checkpoint path at" in job.output and "hpc_ckpt_1.ckpt" in job.output
    assert_like_uninterrupted(job, {k: v for k, v in cfg.items() if k != "slurm"}, reference, tmp_path)


COUNTED = dict(m=2, batch=8, n_train=56, max_epochs=1, sanity=0, timeout=60, threads=1, count_collectives=True)
SCHEDULES = {"gpipe": 2, "1f1b": 2, "interleaved_1f1b": 4, "zbv": 4, "2bw": 2}


@pytest.mark.parametrize("replicas", [1, 2])
@pytest.mark.parametrize("schedule", list(SCHEDULES))
def test_a_steady_step_makes_no_collective(tmp_path, schedule, replicas):
    # the model logs train_loss with prog_bar=True every step; Lightning's own per-step SIGTERM broadcast is gone.
    # With replicas the one collective left is the replicas' gradient average, which DDP makes (ZBV, 2BW: the
    # strategy, one all-reduce of the flat gradients over the replicas of the stage)
    cfg = {"strategy": "pipeline", **COUNTED, "schedule": schedule, "m": SCHEDULES[schedule], "devices": 2 * replicas,
           "n_train": 56 * replicas, "pp": 2}  # fmt: skip
    job = ok(run_job(cfg, tmp_path / "job", timeout=180))
    for r in range(cfg["devices"]):
        # the first step learns the stages and the last runs the epoch's validation (each: one gather of the batch's
        # fingerprint)
        steady = job.rank(r)["collectives"][1:-1]
        assert len(steady) == 5
        for step in steady:
            assert set(step) <= ({"all_reduce@2"} if replicas > 1 else set()), (r, step)
            assert sum(step.values()) <= (1 if replicas > 1 else 0), (r, step)
