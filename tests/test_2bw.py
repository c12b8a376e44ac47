"""PipeDream-2BW (``schedule="2bw"``) against its one-process semantics (``job.TwoBWReference``): every batch of
optimizer window n runs on W(n-1), the step after it updates W(n); validation sees the live weights."""

from __future__ import annotations

import pytest
import torch
from conftest import ok, run_job

from lightning_pp.consolidate import consolidate

LOSS_TOL, PARAM_TOL = 2e-4, 1e-5
BASE = dict(model="tiny", batch=8, n_train=64, n_val=16, sanity=0, m=4)
SCENARIOS = {
    # two epochs, validation mid-epoch (the next batch's heads are in flight while it runs)
    "2_stages_sgd_momentum_validation": dict(optimizer="sgd", lr=0.05, devices=2, max_epochs=2, val_check_interval=3),
    "4_stages_adamw_clipping": dict(optimizer="adamw", lr=0.005, devices=4, clip=0.05, max_epochs=1),
    # and a partial last batch (60 samples), which starts a stream of its own; PipelineMonitor on
    "2_stages_accumulation": dict(
        optimizer="sgd", lr=0.05, devices=2, accumulate=2, max_epochs=1, n_train=60, monitor_pipeline=True
    ),
}


def losses(rows: list[dict], key: str) -> list[tuple[int, float]]:
    return [(r["step"], r[key]) for r in rows if key in r]


def assert_follows(job, devices: int, ref: dict, after_step: int = 0) -> None:
    for key in ("train_loss", "val_loss"):
        expected = [(s, v) for s, v in losses(ref["logged"], key) if s >= after_step]
        for r in range(devices):
            got = [(s, v) for s, v in losses(job.rank(r)["logged"], key) if s >= after_step]
            assert [s for s, _ in got] == [s for s, _ in expected] and expected, (r, key, got, expected)
            assert max(abs(a - b) for (_, a), (_, b) in zip(got, expected)) <= LOSS_TOL, (r, key, got, expected)
    final = job.out / "final.ckpt"
    if final.is_dir():  # sharded
        final = consolidate(final, job.out / "final.pt")
    state = torch.load(final, weights_only=False)["state_dict"]
    assert max((state[k] - v).abs().max().item() for k, v in ref["state"].items()) <= PARAM_TOL


@pytest.mark.parametrize("name", list(SCENARIOS))
def test_2bw_trains_as_its_one_process_semantics(name, tmp_path, reference):
    cfg = {**BASE, **SCENARIOS[name]}
    ref = reference(**cfg, reference_2bw=True)
    job = ok(run_job({**cfg, "strategy": "pipeline", "schedule": "2bw"}, tmp_path / "job", timeout=240))
    assert_follows(job, cfg["devices"], ref)
    if cfg.get("monitor_pipeline"):  # PipelineMonitor times the stream as it times torch's schedules
        bubbles = [r["pipeline/bubble"] for r in job.rank(0)["logged"] if "pipeline/bubble" in r]
        assert bubbles and all(0 < b < 1 for b in bubbles), bubbles
    if name == "2_stages_sgd_momentum_validation":  # the comparison can tell: plain 1F1B fails it
        flushing = ok(run_job({**cfg, "strategy": "pipeline", "schedule": "1f1b"}, tmp_path / "flushing"))
        with pytest.raises(AssertionError):
            assert_follows(flushing, cfg["devices"], ref)
        train = [v for _, v in losses(flushing.rank(0)["logged"], "train_loss")]
        delayed = [v for _, v in losses(ref["logged"], "train_loss")]
        assert abs(train[0] - delayed[0]) <= LOSS_TOL < abs(train[1] - delayed[1])  # batch 1: on W(1), or W(0)


@pytest.mark.parametrize("state_dict_type", ["full", "sharded"])
def test_2bw_resumed_from_a_mid_epoch_checkpoint_continues_as_uninterrupted(state_dict_type, tmp_path, reference):
    # saved at step 6 of 8 per epoch, with the next batch's first micro-batches in flight (recomputed on resume);
    # the loader's position is saved too (a plain DataLoader would restart its epoch on a mid-epoch resume)
    cfg = {**BASE, "optimizer": "sgd", "lr": 0.05, "devices": 2, "max_epochs": 2, "max_steps": 11, "save_every": 3,
           "resumable": True}  # fmt: skip
    ref = reference(**cfg, reference_2bw=True)
    first = ok(run_job({**cfg, "strategy": "pipeline", "schedule": "2bw", "state_dict_type": state_dict_type},
                       tmp_path / "first"))  # fmt: skip
    assert_follows(first, 2, ref)
    resumed = ok(run_job({**cfg, "save_every": None, "strategy": "pipeline", "schedule": "2bw",
                          "resume": str(first.out / "ckpts" / "step=6.ckpt")}, tmp_path / "resumed"))  # fmt: skip
    assert_follows(resumed, 2, ref, after_step=6)
    if state_dict_type == "full":  # the live weights load into the plain module; the older version rides along
        ckpt = torch.load(first.out / "ckpts" / "step=6.ckpt", weights_only=False)
        assert all("pipedream_2bw_older_weights" in s for s in ckpt["optimizer_states"][0]["state"].values())


def test_2bw_with_replicas_resumes_a_1f1b_checkpoint_on_the_live_weights(tmp_path, reference):
    # one epoch of 1F1B, then 2BW on 2 replicas x 2 stages: the checkpoint holds no older version, so the first
    # window runs on the live weights (said in the log), as the one-process semantics on the combined batch do
    cfg = {**BASE, "optimizer": "sgd", "lr": 0.05}
    first = ok(run_job({**cfg, "strategy": "pipeline", "devices": 2, "max_epochs": 1}, tmp_path / "first"))
    resume = str(first.out / "final.ckpt")
    ref = reference(**{**cfg, "batch": 16, "replicas_order": True}, max_epochs=2, resume=resume, reference_2bw=True)
    job = ok(run_job({**cfg, "strategy": "pipeline", "schedule": "2bw", "devices": 4, "pp": 2, "max_epochs": 2,
                      "resume": resume}, tmp_path / "replicas"))  # fmt: skip
    assert job.output.count("holds no older weight version") == 1
    state = job.state()
    assert max((state[k] - v).abs().max().item() for k, v in ref["state"].items()) <= PARAM_TOL
    # each replica logs its own batch's loss; their mean is the combined batch's
    own = [[v for s, v in losses(job.rank(r)["logged"], "train_loss") if s >= 8] for r in (0, 2)]
    expected = [v for s, v in losses(ref["logged"], "train_loss") if s >= 8]
    assert len(expected) == 4 and max(abs((a + b) / 2 - c) for a, b, c in zip(*own, expected)) <= LOSS_TOL
