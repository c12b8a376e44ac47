"""A pipelined run equals plain Lightning on one process: logged losses, validation, parameters."""

from __future__ import annotations

import pytest
import torch
from conftest import ok, run_job
from job import MODELS

LOSS_TOL = 2e-4
PARAM_TOL = 1e-6

# each scenario: a pipelined job, and what it is compared against
SCENARIOS = {
    "gpipe-2-clip-partial": dict(schedule="gpipe", devices=2, m=4, batch=8, n_train=68, clip=0.05),
    # the strategy's defaults on a module written for one process: layers not named, a forward that calls every
    # part (split=None traces it), batches as Hugging Face's data collators return them (a BatchEncoding)
    "1f1b-2-defaults-unskipping-forward-monitor-hf-batches": dict(
        model="noskip",
        layers=None,
        split=None,
        encoded=True,
        schedule="1f1b",
        devices=2,
        m=None,
        batch=8,
        val_batch=6,
        n_train=36,
        n_val=30,
        val_check_interval=0.5,
        monitor=True,
    ),
    "1f1b-2-accumulate-syncdist-recompute": dict(
        schedule="1f1b",
        devices=2,
        m=2,
        batch=8,
        n_train=64,
        accumulate=2,
        sync_dist=True,
        params=True,
        activation_checkpointing=True,
    ),
    "gpipe-4-sgd-clip": dict(
        schedule="gpipe", devices=4, m=4, batch=8, n_train=48, clip=0.05, optimizer="sgd", lr=0.5, params=True
    ),
    "gpipe-3-wrapped-network-profiled": dict(
        schedule="gpipe",
        devices=3,
        m=3,
        batch=6,
        n_train=36,
        n_val=30,
        model="wrapped",
        layers="model.layers",
        balance="profile",
    ),
    "1f1b-4-partial-syncdist": dict(schedule="1f1b", devices=4, m=4, batch=8, n_train=44, sync_dist=True),
}


PIPELINE_ONLY = (
    "schedule", "devices", "m", "params", "layers", "balance", "activation_checkpointing", "pp", "data_parallel",
    "fsdp_reshard", "tp", "weighted", "ep",
)  # fmt: skip


def common(cfg: dict) -> dict:
    """The scenario's settings that a one-process run shares."""
    return {k: v for k, v in cfg.items() if k not in PIPELINE_ONLY}


def assert_same_logs(pipe: dict, ref: dict, tol: float) -> None:
    steps = [r for r in ref["logged"] if "train_loss" in r]
    got = [r for r in pipe["logged"] if "train_loss" in r]
    assert len(got) == len(steps) > 3
    for a, b in zip(got, steps):
        assert a["step"] == b["step"]
        assert abs(a["train_loss"] - b["train_loss"]) <= tol, (a, b)
    val = [r["val_loss"] for r in ref["logged"] if "val_loss" in r]
    assert [abs(a["val_loss"] - b) <= tol for a, b in zip([r for r in pipe["logged"] if "val_loss" in r], val)] == [
        True
    ] * len(val)


@pytest.mark.parametrize("name", list(SCENARIOS))
def test_pipeline_matches_one_process(name, tmp_path, reference):
    cfg = SCENARIOS[name]
    job = ok(run_job({**cfg, "strategy": "pipeline"}, tmp_path / "job", timeout=240))
    ref = reference(**common(cfg))
    ranks = [job.rank(r) for r in range(cfg["devices"])]
    if "split" in cfg:  # the defaults found the layers and chose to trace, said once
        assert job.output.count("Splitting 'net.blocks' into stages: 4 layers (ResidualBlock)") == 1, job.output[-3000:]
        assert job.output.count("forward calls the parts other stages hold instead of skipping them (on stage 1") == 1
    if cfg.get("balance") == "profile":
        # timed on the sanity check's first batch (an inference tensor), split by the agreed costs, logged once
        assert job.output.count("Profiled forward+backward per micro-batch") == 1, job.output[-3000:]

    # what rank 0's logger received equals what plain Lightning logged, step by step
    assert_same_logs(ranks[0], ref, LOSS_TOL)
    # one pipeline logs exact values on every rank: Lightning's advice to sync them is not given
    assert "when logging on epoch level in distributed setting" not in job.output
    # every rank's callback_metrics saw the same values (so monitor= callbacks work everywhere)
    for rank in ranks:
        assert len(rank["train"]) == len(ref["train"])
        for a, b in zip(rank["train"], ref["train"]):
            assert abs(a["train_loss"] - b["train_loss"]) <= LOSS_TOL
            assert a["train_max"] >= a["train_loss"] - 1e-6  # max over micro-batches
        assert len(rank["val"]) == len(ref["val"]) >= 1
        for a, b in zip(rank["val"], ref["val"]):
            assert abs(a["val_loss"] - b["val_loss"]) <= LOSS_TOL
        if cfg.get("monitor"):
            # ModelCheckpoint/EarlyStopping/ReduceLROnPlateau read the relayed values on every rank
            assert abs(rank["best_score"] - ref["best_score"]) <= LOSS_TOL
            assert rank["lr"] == ref["lr"] and rank["lr"][0] < 1e-2
        assert rank["threads"] == max(1, torch.get_num_threads() // cfg["devices"]) or rank["threads"] == 1

    if cfg.get("clip"):
        # the clipping binds: without it the same run logs other losses
        free = reference(**{**common(cfg), "clip": None})
        assert max(abs(a["train_loss"] - b["train_loss"]) for a, b in zip(free["train"], ref["train"])) > 1e-3

    # the gathered checkpoint holds every tensor of the module under its one-process name
    state = job.state()
    assert set(state) == set(ref["state"])

    if cfg.get("params"):
        assert_exact_parameters(job, cfg, reference)


def assert_exact_parameters(job, cfg: dict, reference, reversed_backward: bool = False) -> None:
    """Parameters and optimizer state equal a one-process run fed the same micro-batches.

    ``reversed_backward``: the schedule runs backward last micro-batch first, so the reference sums
    gradients in that order too (float sums depend on it, and Adam amplifies the difference).
    """
    state = job.state()
    # exact arithmetic: a one-process reference fed the same micro-batches
    micro = reference(
        **{**common(cfg), "batch": cfg["batch"] // cfg["m"], "accumulate": cfg["m"] * cfg.get("accumulate", 1)},
        **({"reverse_within": cfg["batch"]} if reversed_backward else {}),
    )
    initial = micro["initial"]
    for key, value in micro["state"].items():
        assert torch.allclose(state[key], value, atol=PARAM_TOL, rtol=0), (
            key,
            (state[key] - value).abs().max().item(),
        )
    # every stage trained: each layer moved well beyond the tolerance
    for block in sorted({k.split(".")[2] for k in state if k.startswith("net.blocks.")}):
        moved = max((state[k] - initial[k]).abs().max().item() for k in state if k.startswith(f"net.blocks.{block}."))
        assert moved > 100 * PARAM_TOL, (block, moved)
    for key in ("net.embed.weight", "net.pos", "net.head.weight", "final_norm.weight"):
        assert (state[key] - initial[key]).abs().max().item() > 100 * PARAM_TOL, key

    # the optimizer state is saved in the one-process layout, and the file loads into the plain module
    ckpt = torch.load(job.out / "final.ckpt", weights_only=False)
    mine, theirs = ckpt["optimizer_states"][0], micro["optimizer"]
    assert [g["params"] for g in mine["param_groups"]] == [g["params"] for g in theirs["param_groups"]]
    assert sorted(mine["state"]) == sorted(theirs["state"])
    for index, slots in theirs["state"].items():
        for slot, value in slots.items():
            assert torch.allclose(mine["state"][index][slot], value, atol=PARAM_TOL, rtol=0), (index, slot)
    model = MODELS[cfg.get("model", "tiny")].load_from_checkpoint(job.out / "final.ckpt")
    assert torch.equal(model.net.head.weight, state["net.head.weight"])


def test_bf16_mixed_on_three_stages_matches_one_process(tmp_path, reference):
    cfg = dict(schedule="1f1b", devices=3, m=3, batch=6, n_train=36, n_val=30, precision="bf16-mixed")
    job = ok(run_job({**cfg, "strategy": "pipeline"}, tmp_path / "job", timeout=240))
    ref = reference(**common(cfg))
    assert_same_logs(job.rank(0), ref, 2e-2)
    for rank in range(3):
        assert abs(job.rank(rank)["train"][-1]["train_loss"] - ref["train"][-1]["train_loss"]) <= 2e-2
