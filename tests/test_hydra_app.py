"""The Hydra app: configs compose, bad overrides name their key, multirun jobs run their own ranks,
and a job spans two loopback nodes (torchrun) or a SLURM-style launch."""

from __future__ import annotations

import csv
import json
import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch
from conftest import child_env, free_port, run_module, run_two_nodes
from hydra import compose, initialize_config_module
from hydra.utils import instantiate
from models import transformers_at_least

from lightning_pp import empty_weights, materialize
from lightning_pp.errors import PipelineConfigError
from lightning_pp.train.app import check_config
from lightning_pp.train.replica_groups import fault_tolerance

QUICK = ["trainer.max_epochs=1", "trainer.limit_train_batches=6", "trainer.limit_val_batches=2",
         "trainer.log_every_n_steps=1", "trainer.enable_progress_bar=false", "trainer.enable_model_summary=false",
         "data.batch_size=8"]  # fmt: skip


def compose_app(*overrides: str):
    with initialize_config_module("lightning_pp.conf", version_base="1.3"):
        return compose("config", overrides=list(overrides), return_hydra_config=True)


def app(args: list[str], cwd: Path, timeout: float = 240, ranks: int = 1) -> subprocess.CompletedProcess:
    """``python -m lightning_pp.train *args``, as a user runs it (its first process's imports done once), or with
    ``ranks`` as ``torchrun --nproc_per_node ranks -m lightning_pp.train *args`` runs it (every rank forked)."""
    return run_module("lightning_pp.train", args, cwd, timeout, ranks=ranks)


def logged_losses(run_dir: Path) -> list[float]:
    (metrics,) = run_dir.glob("logs/version_*/metrics.csv")
    with metrics.open() as f:
        return [float(r["train_loss"]) for r in csv.DictReader(f) if r.get("train_loss")]


@pytest.mark.parametrize(
    "overrides",
    [
        [],
        ["model=gpt_small"],
        ["model=gpt_large", "strategy.state_dict_type=sharded"],
        ["model=digits_mlp", "data=digits"],
        ["model=gpt2_tiny"],
        ["model=llama_tiny"],
        ["model=llama_tiny", "peft=lora", "peft.r=4"],
        ["model=llama_tiny", "samples=progressions"],
        ["model=qwen3_moe_tiny", "trainer.devices=4", "strategy.expert_parallel_size=2"],
        ["trainer=gpu"],
        ["trainer=cpu_fp16"],
        ["trainer=slurm", "hydra/launcher=slurm"],
        ["logger=tensorboard", "callbacks=none"],
        ["strategy.schedule=gpipe", "strategy.balance=[1,3]", "strategy.n_microbatches=8"],
        [
            "trainer.devices=8",
            "strategy.data_parallel=fsdp",
            "strategy.fsdp_reshard=microbatch",
            "strategy.tensor_parallel_size=2",
            "strategy.pipeline_parallel_size=2",
        ],
        ["strategy.microbatch_weight={_target_:lightning_pp.label_tokens,_partial_:true,key:targets}"],
        ["ft=local", "ft.groups=3"],
        ["ft=group", "ft.group=1", "ft.lighthouse=http://node0:29510"],
    ],
)
def test_every_config_group_composes(overrides):
    cfg = compose_app(*overrides)
    assert cfg.strategy._target_ == "lightning_pp.PipelineStrategy"
    assert set(cfg.strategy) - {"_target_"} == {
        "schedule", "n_microbatches", "pipeline_parallel_size", "layers", "balance", "stages_per_rank",
        "activation_checkpointing", "state_dict_type", "split", "init_fn", "timeout", "data_parallel", "fsdp_reshard",
        "tensor_parallel_size", "expert_parallel_size", "microbatch_weight", "init_weights", "init_weights_keys",
        "async_save", "init_adapter", "save_frozen", "compile", "memory_limit", "checksums", "fault_tolerance",
    }  # fmt: skip
    if "model=gpt2_tiny" in overrides:  # the model's config sets how the strategy splits it
        assert (cfg.strategy.split, cfg.strategy.layers) == ("trace", "model.transformer.h")
    if "model=llama_tiny" in overrides or "model=qwen3_moe_tiny" in overrides:
        assert (cfg.strategy.split, cfg.strategy.layers) == ("trace", "model.model.layers")
    if "peft=lora" in overrides:  # the model is given peft.LoraConfig's arguments; no adapters by default
        lora = instantiate(cfg.model.peft)
        assert (lora.r, lora.lora_alpha, lora.target_modules) == (4, 16, {"q_proj", "v_proj"})
    else:
        assert cfg.peft is None and "peft" not in cfg.model
    assert cfg.trainer._target_ == "lightning.pytorch.Trainer"
    if "trainer=cpu_fp16" in overrides:  # real fp16 on the CPU: the plugin, not the flag (Lightning would use bf16)
        (plugin,) = instantiate(cfg.trainer.plugins)
        assert cfg.trainer.precision is None and plugin.precision == "16-mixed" and plugin.scaler.get_scale() == 1024
    if "hydra/launcher=slurm" in overrides:
        assert cfg.hydra.launcher.nodes == 2 and cfg.hydra.launcher.tasks_per_node == 4
    ft = fault_tolerance(cfg)  # ft=group: this job is one replica group, its keys the strategy's fault_tolerance
    assert cfg.ft.mode == next((o.split("=")[1] for o in overrides if o.startswith("ft=")), "none")
    if cfg.ft.mode == "group":
        strategy = instantiate(cfg.strategy, fault_tolerance=ft)
        assert (strategy.fault_tolerance.group, strategy.fault_tolerance.lighthouse) == (1, "http://node0:29510")
    else:
        assert ft is None
    if "samples=progressions" in overrides:  # GenerateSamples, its sampling arguments generate's
        samples = instantiate(cfg.samples)
        assert samples.prompts == [[3, 7, 11, 15, 19], [10, 12, 14]] and samples.sampling["max_new_tokens"] == 8
    else:
        assert cfg.samples is None
    if cfg.strategy.microbatch_weight is not None:  # a function named in the config: padded labels' token count
        weight = instantiate(cfg.strategy).microbatch_weight
        assert weight({"targets": torch.tensor([[1, 2, 3, -100], [4, 5, -100, -100]])}) == 3


@pytest.mark.parametrize(
    "overrides,match",
    [
        (["strategy.schedule=pipedream"], r"strategy.schedule=pipedream: Unknown schedule"),
        (["strategy.pipeline_parallel_size=3", "trainer.devices=2"], r"strategy.pipeline_parallel_size=3 does not"),
        (["trainer.devices=4", "trainer.num_nodes=2", "model.n_layers=4"], r"model.n_layers=4 is less than the 8"),
    ],
)
def test_bad_overrides_name_the_config_key(overrides, match):
    with pytest.raises(PipelineConfigError, match=match):
        check_config(compose_app(*overrides))


def test_bad_override_fails_the_app_before_any_process_starts(tmp_path):
    proc = app(["strategy.schedule=pipedream", f"hydra.run.dir={tmp_path}/run"], tmp_path, timeout=60)
    assert proc.returncode != 0
    assert "strategy.schedule=pipedream: Unknown schedule='pipedream'" in proc.stderr
    assert not (tmp_path / "run" / "rank0.json").exists()


def test_default_job_writes_results_and_learns(tmp_path):
    run_dir = tmp_path / "run"
    with_summary = [o for o in QUICK if not o.startswith("trainer.enable_model_summary")]
    proc = app([*with_summary, "trainer.limit_train_batches=40", "monitor=true", f"hydra.run.dir={run_dir}"], tmp_path)
    assert proc.returncode == 0, proc.stderr[-3000:]
    # Lightning's (rich) model summary: the whole model's parameters (each stage holds 104 K), no FLOPs it never
    # counted (the module has no example_input_array)
    assert "Total params: 208 K" in proc.stdout and "FLOPs" not in proc.stdout + proc.stderr, proc.stdout
    # each rank's log file holds that rank's log records (Lightning's and lightning_pp's loggers)
    rank0_log, rank1_log = (run_dir / "train.log").read_text(), (run_dir / "train_rank1.log").read_text()
    assert "Initializing distributed: GLOBAL_RANK: 0" in rank0_log and "Pipeline placement (2 stages" in rank0_log
    assert "Initializing distributed: GLOBAL_RANK: 1" in rank1_log and "GLOBAL_RANK: 0" not in rank1_log
    # metrics.csv: the fit's own validation (one, at its last step), not the app's validation after fit
    with (run_dir / "logs" / "version_0" / "metrics.csv").open() as f:
        validations = [(r["epoch"], r["step"]) for r in csv.DictReader(f) if r.get("val_loss")]
    assert validations == [("0", "39")], validations
    # the monitor switch: timeline and Gantt chart of the last step next to the logs
    assert {p.name for p in run_dir.glob("logs/version_0/pipeline_*")} == {
        "pipeline_trace.json",
        "pipeline_schedule.png",
    }
    result = json.loads((run_dir / "result.json").read_text())
    assert result["schedule"] == "1f1b" and result["stages"] == 2 and result["world_size"] == 2
    assert result["n_microbatches"] == 8 and result["tokens_per_s"] == pytest.approx(32 * result["samples_per_s"])
    assert result["val_loss"] < 3.0 < 4.0 < logged_losses(run_dir)[0]  # ln(64) = 4.16 at the start
    for rank in range(2):
        info = json.loads((run_dir / f"rank{rank}.json").read_text())
        assert info["world_size"] == 2 and info["strategy"]["schedule"] == "1f1b" and info["threads"] == 1
    # the same command in the same run directory (a restarted job) goes on from its last checkpoint (resume=last);
    # restarted as torchrun restarts it (every rank at once: Lightning's launcher ran the first); weights_only=false
    # (a checkpoint one trusts) reaches fit
    again = app([*QUICK, "trainer.limit_train_batches=4", "trainer.max_epochs=2", f"hydra.run.dir={run_dir}",
                 "weights_only=false"], tmp_path, ranks=2)  # fmt: skip
    assert again.returncode == 0, again.stderr[-3000:]
    assert f"Restoring states from the checkpoint path at {run_dir / 'checkpoints' / 'last.ckpt'}" in again.stderr
    with (run_dir / "logs" / "version_1" / "metrics.csv").open() as f:
        steps = [int(r["step"]) for r in csv.DictReader(f) if r.get("train_loss")]
    assert steps == [40, 41, 42, 43], steps


def test_hf_gpt2_trains_through_the_app_split_by_the_tracer(tmp_path):
    # built on meta by the app, traced on meta, each rank materialising its stage by HF's own init rule
    run_dir = tmp_path / "run"
    # under torchrun (the default job and the multirun run the app under Lightning's launcher)
    proc = app([*QUICK, "model=gpt2_tiny", "trainer.limit_train_batches=12", f"hydra.run.dir={run_dir}",
                "samples=progressions"], tmp_path, ranks=2)  # fmt: skip
    assert proc.returncode == 0, proc.stderr[-3000:]
    assert "shared by stages [0, 1] (gradients summed): model.transformer.wte.weight = model.lm_head.weight" in (
        proc.stdout + proc.stderr
    )
    losses = logged_losses(run_dir)
    assert losses[-1] < losses[0] - 0.5, losses
    # samples=progressions: the model's continuations of two prompts at the fit's one validation, beside the metrics
    with next(run_dir.glob("logs/version_*/samples.csv")).open() as f:
        rows = list(csv.DictReader(f))
    assert [(r["step"], r["prompt"]) for r in rows] == [("12", "3 7 11 15 19"), ("12", "10 12 14")]
    assert all(len(r["sample"].split()) == 8 for r in rows)


def test_lora_trains_only_the_adapters_through_the_app(tmp_path):
    # peft=lora: the app's HF Qwen3-MoE wrapped by get_peft_model, built on meta, LoRA on the attention and on the
    # experts' stacked weights (peft.target_parameters); its layers=model.model.layers resolved
    # (2 layers, no validation: each trace of the model on meta, one per mode, costs seconds)
    run_dir = tmp_path / "run"
    experts = "peft.target_parameters=[mlp.experts.gate_up_proj,mlp.experts.down_proj]"
    lora = ["model=qwen3_moe_tiny", "model.n_layers=2", "peft=lora", experts]
    if not transformers_at_least(5, 23):  # transformers < 5.23: its load-balancing loss is refused under the trace
        lora.append("model.output_router_logits=false")
    quick = [o for o in QUICK if not o.startswith("trainer.limit_val_batches")] + ["trainer.limit_val_batches=0"]
    proc = app([*quick, *lora, "trainer.limit_train_batches=4", f"hydra.run.dir={run_dir}"], tmp_path, ranks=2)
    assert proc.returncode == 0, proc.stderr[-3000:]
    assert "layers='model.model.layers' resolved to 'model.base_model.model.model.layers' (inside a peft model)" in (
        proc.stdout + proc.stderr
    )
    state = torch.load(run_dir / "checkpoints" / "last.ckpt", weights_only=False)["state_dict"]
    cfg = compose_app(*lora)
    with empty_weights():  # the start every rank materialised its stage from (the name rule, seed 0)
        initial = materialize(instantiate(cfg.model), seed=0).state_dict()
    assert state.keys() == initial.keys()
    adapters = [k for k in state if ".lora_" in k]  # q_proj, v_proj and the two experts' stacks of 2 layers
    assert len(adapters) == 16 and all(not torch.equal(state[k], initial[k]) for k in adapters)
    assert all(torch.equal(state[k], initial[k]) for k in state if k not in adapters)


def test_multirun_runs_each_job_with_its_own_ranks(tmp_path):
    sweep = tmp_path / "sweep"
    plain_summary = "+callbacks.summary._target_=lightning.pytorch.callbacks.ModelSummary"  # its text in the log
    with_summary = [o for o in QUICK if not o.startswith("trainer.enable_model_summary")]
    proc = app(["-m", "strategy.n_microbatches=2", "trainer.devices=2,3", "strategy.schedule=gpipe", *with_summary,
                plain_summary, f"hydra.sweep.dir={sweep}"], tmp_path, timeout=400)  # fmt: skip
    assert proc.returncode == 0, proc.stderr[-3000:]
    # the sweep's end points to what it wrote
    assert f"Sweep summary: {sweep / 'summary.csv'} (one row per job) and {sweep / 'summary.png'}" in proc.stdout
    jobs = sorted(p for p in sweep.iterdir() if p.is_dir() and p.name.isdigit())
    assert len(jobs) == 2
    seen = set()
    for job in jobs:
        result = json.loads((job / "result.json").read_text())
        overrides = dict(o.split("=", 1) for o in result["overrides"])
        devices, m = int(overrides["trainer.devices"]), int(overrides["strategy.n_microbatches"])
        seen.add((devices, m))
        ranks = sorted(job.glob("rank*.json"))
        assert len(ranks) == devices  # every rank of this job wrote into this job's directory
        pids = set()
        for path in ranks:
            info = json.loads(path.read_text())
            assert info["world_size"] == devices and info["strategy"]["n_microbatches"] == m
            assert info["strategy"]["schedule"] == "gpipe"
            pids.add(info["pid"])
        assert len(pids) == devices
        # each job's log file holds its own records (not the previous job's), with the whole model's plain summary
        # and no FLOPs
        rank0_log = (job / "train.log").read_text()
        assert f"MEMBER: 1/{devices}" in rank0_log and f"MEMBER: 1/{5 - devices}" not in rank0_log
        assert "208 K     Total params" in rank0_log and "flops" not in rank0_log.lower(), rank0_log
        assert f"GLOBAL_RANK: {devices - 1}," in (job / f"train_rank{devices - 1}.log").read_text()
    assert seen == {(2, 2), (3, 2)}
    with (sweep / "summary.csv").open() as f:
        rows = list(csv.DictReader(f))
    assert list(rows[0])[:8] == ["job", "schedule", "stages", "n_microbatches", "train_loss", "val_loss",
                                 "samples_per_s", "wall_s"]  # fmt: skip
    assert "trainer.devices" in rows[0] and len(rows) == 2
    for row in rows:
        assert 0 < float(row["train_loss"]) < 10 and 0 < float(row["val_loss"]) < 10
        assert int(row["stages"]) == int(row["trainer.devices"])
    assert (sweep / "summary.png").stat().st_size > 10_000


@pytest.fixture(scope="module")
def one_node_losses(tmp_path_factory):
    tmp = tmp_path_factory.mktemp("one_node")
    proc = app([*QUICK, f"hydra.run.dir={tmp}/run"], tmp, ranks=2)  # as torchrun runs it
    assert proc.returncode == 0, proc.stderr[-3000:]
    return logged_losses(tmp / "run")


def test_two_loopback_nodes_match_one_node(tmp_path, one_node_losses):
    run_dir = tmp_path / "run"
    run_two_nodes(
        1,
        ["-m", "lightning_pp.train", *QUICK, "trainer.num_nodes=2", "trainer.devices=1", f"hydra.run.dir={run_dir}"],
        per_node=lambda node: [f"hydra.output_subdir={'.hydra' if node == 0 else 'null'}"],
        cwd=tmp_path,
    )
    for rank in range(2):
        info = json.loads((run_dir / f"rank{rank}.json").read_text())
        assert info["world_size"] == 2 and info["cluster_environment"] == "TorchElasticEnvironment"
    losses = logged_losses(run_dir)
    assert len(losses) == len(one_node_losses) >= 6
    assert max(abs(a - b) for a, b in zip(losses, one_node_losses)) <= 2e-4


def test_slurm_style_launch_matches_one_node(tmp_path, one_node_losses):
    run_dir, port = tmp_path / "run", free_port()
    procs = {}
    for rank in (1, 0):  # started out of launch order, as srun may
        env = {**child_env(), "SLURM_NTASKS": "2", "SLURM_NTASKS_PER_NODE": "2", "SLURM_PROCID": str(rank),
               "SLURM_LOCALID": str(rank), "SLURM_NODEID": "0", "SLURM_JOB_ID": "4242", "SLURM_JOB_NAME": "pp",
               "SLURM_NODELIST": "127.0.0.1", "MASTER_ADDR": "127.0.0.1", "MASTER_PORT": str(port),
               "OMP_NUM_THREADS": "1"}  # fmt: skip
        args = [*QUICK, f"hydra.run.dir={run_dir}", f"hydra.output_subdir={'.hydra' if rank == 0 else 'null'}"]
        procs[rank] = subprocess.Popen([sys.executable, "-m", "lightning_pp.train", *args], cwd=tmp_path, env=env,
                                       stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)  # fmt: skip
    outputs = {r: p.communicate(timeout=240)[0] for r, p in procs.items()}
    assert all(p.returncode == 0 for p in procs.values()), outputs[0][-3000:] + outputs[1][-3000:]
    for rank in range(2):
        info = json.loads((run_dir / f"rank{rank}.json").read_text())
        assert info["cluster_environment"] == "SLURMEnvironment" and info["world_size"] == 2
    losses = logged_losses(run_dir)
    assert max(abs(a - b) for a, b in zip(losses, one_node_losses)) <= 2e-4
    assert os.environ.get("SLURM_PROCID") is None


def test_a_users_own_config_dir_reaches_every_rank(tmp_path):
    mine = tmp_path / "my_conf"
    mine.mkdir()
    (mine / "experiment.yaml").write_text("defaults:\n  - config\n  - _self_\nstrategy:\n  schedule: gpipe\n")
    run_dir = tmp_path / "run"
    proc = app(["--config-dir", str(mine), "--config-name", "experiment", "model=digits_mlp", "data=digits", *QUICK,
                "data.batch_size=32", f"hydra.run.dir={run_dir}"], tmp_path)  # fmt: skip
    assert proc.returncode == 0, proc.stderr[-3000:]
    for rank in range(2):
        assert json.loads((run_dir / f"rank{rank}.json").read_text())["strategy"]["schedule"] == "gpipe"
    # the digits classifier (scikit-learn's bundled data): no tokens, and it learns
    result = json.loads((run_dir / "result.json").read_text())
    assert result["tokens_per_s"] is None and result["samples_per_s"] > 0 and result["val_loss"] < 2.3
