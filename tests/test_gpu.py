"""On CUDA: the paths the CPU suite cannot take (NCCL between stages, every stage of a multi-stage schedule on one
device in fp32, bf16 and fp16, stages materialised on their device, FSDP2 inside stages, the CUDA GradScaler, CUDA's
MoE branch, background saves from CUDA tensors, 2BW, CUDA-event telemetry), each against one GPU
running the same module on the same data. They skip on a machine without enough GPUs, saying how many they
need; ``scripts/gpu_check.sh`` runs them with the benchmarks on whatever GPUs it finds."""

from __future__ import annotations

import json

import pytest
import torch
from conftest import ok, run_job
from test_2bw import assert_follows
from test_adapters import LORA
from test_frozen import _micro
from test_moe import MOE
from test_parity import assert_same_logs, common
from test_generate import generate_job_against_one_process, same_as_one_process
from test_tied import assert_state_equal, combined

from lightning_pp.checkpoints.formats import load_sharded

GPUS = torch.cuda.device_count()
# a pipeline's micro-batches reach cuBLAS in other shapes than one process's batches: kernels sum in other orders
LOSS_TOL, PARAM_TOL = 1e-3, 1e-4

pytestmark = pytest.mark.gpu


def gpus(n: int) -> pytest.MarkDecorator:
    return pytest.mark.skipif(
        GPUS < n, reason=f"needs {n} CUDA device(s), this machine has {GPUS}: run scripts/gpu_check.sh on a GPU machine"
    )


CUDA = dict(accelerator="cuda", batch=8, n_train=32, n_val=16, sanity=0, timeout=120)


def pipelined(cfg: dict, tmp_path, name: str = "job"):
    return ok(run_job({**cfg, "strategy": "pipeline"}, tmp_path / name, timeout=600, launcher=True))


@gpus(2)
@pytest.mark.parametrize("schedule, m", [("1f1b", 2), ("zbv", 4)])
def test_nccl_between_stages_trains_as_one_gpu(schedule, m, tmp_path, reference):
    cfg = dict(CUDA, schedule=schedule, devices=2, m=m)
    job = pipelined(cfg, tmp_path)
    for r in range(2):  # each rank on its own device, over NCCL
        assert job.rank(r)["backend"] == "nccl" and job.rank(r)["param_devices"] == [f"cuda:{r}"]
    ref = reference(**common(cfg))
    assert_same_logs(job.rank(0), ref, LOSS_TOL)
    assert_state_equal(job.state(), ref["state"], PARAM_TOL)


@gpus(1)
@pytest.mark.parametrize("precision", ["32-true", "bf16-mixed", "16-mixed"])
@pytest.mark.parametrize("schedule", ["zbv", "interleaved_1f1b", "looped_bfs"])
def test_one_gpu_holds_every_stage_of_a_multi_stage_schedule(schedule, precision, tmp_path, reference):
    # a V's two stages, or a loop's, on one device: handed over without P2P; 16-mixed: the CUDA GradScaler's one
    # scale over every stage's gradients, stepped as one GPU steps it
    cfg = dict(CUDA, schedule=schedule, devices=1, m=4, precision=precision)
    job = pipelined(cfg, tmp_path)
    assert job.rank(0)["param_devices"] == ["cuda:0"]
    ref = reference(**common(cfg))
    assert_same_logs(job.rank(0), ref, LOSS_TOL if precision == "32-true" else 5e-3)
    if precision == "16-mixed":
        assert job.rank(0)["scale"] == ref["scale"]


@gpus(1)
def test_one_gpu_trains_a_moe_model_at_its_defaults_on_cuda_s_branch(tmp_path, reference):
    # transformers' grouped_mm experts count tokens with CUDA's integer histogram (histc of .int() ids), the branch
    # the trace on meta records and the CPU suite counts in float: here it runs as recorded
    cfg = dict(MOE, **{k: CUDA[k] for k in ("accelerator", "sanity", "timeout")}, model="qwen3_moe", schedule="zbv",
               devices=1, m=4, batch=8, n_train=24)  # fmt: skip
    job = pipelined(cfg, tmp_path)
    assert job.rank(0)["param_devices"] == ["cuda:0"]
    assert_state_equal(job.state(), reference(**_micro(cfg))["state"], PARAM_TOL)


@gpus(1)
def test_sharded_checkpoints_saved_in_the_background_from_cuda_tensors_are_whole(tmp_path, reference):
    # async_save stages the GPU's tensors on the host and writes them while training goes on: the step-4 directory
    # holds step 4's weights, the last one the final weights, each equal to one GPU's
    cfg = dict(CUDA, schedule="interleaved_1f1b", devices=1, m=4, max_steps=6, state_dict_type="sharded",
               save_every=2, async_save=True)  # fmt: skip
    job = pipelined(cfg, tmp_path)
    for step, name in ((4, "ckpts/step=4.ckpt"), (6, "final.ckpt")):
        ref = reference(**{**common(cfg), "max_steps": step})
        assert_state_equal(load_sharded(job.out / name)["state_dict"], ref["state"], PARAM_TOL)


@gpus(1)
def test_one_gpu_holds_a_v_behind_a_frozen_stage(tmp_path, reference):
    # stage 0 (embedding, first block) frozen: stage 1's input carries no gradient (runtime/split_backward.py)
    cfg = dict(CUDA, model="frozen", schedule="zbv", devices=1, m=4, n_layers=2)
    job = pipelined(cfg, tmp_path)
    ref = reference(**{**common(cfg), "batch": cfg["batch"] // cfg["m"], "accumulate": cfg["m"]})
    assert_state_equal(job.state(), ref["state"], PARAM_TOL)
    assert torch.equal(job.state()["net.blocks.b0.ff.0.weight"], ref["initial"]["net.blocks.b0.ff.0.weight"])


@gpus(1)
def test_one_gpu_compiles_each_block_of_two_stages_with_inductor_in_bf16(tmp_path, reference):
    # compile=True on CUDA (two stages of interleaved 1F1B on the GPU): inductor's Triton kernels, every frame
    # compiled (none left to eager), against one GPU running the pipeline's micro-batches through the same blocks
    cfg = dict(CUDA, schedule="interleaved_1f1b", devices=1, m=4, n_layers=4, compile=True, precision="bf16-mixed")
    job = pipelined(cfg, tmp_path)
    dynamo = job.rank(0)["dynamo"]
    assert "recompile_limit" not in job.output
    assert dynamo["frames"]["ok"] == dynamo["frames"]["total"] > 0 and dynamo["stats"]["unique_graphs"] > 0, dynamo
    assert_state_equal(job.state(), reference(**_micro(cfg))["state"], PARAM_TOL)


@gpus(1)
def test_one_gpu_trains_lora_on_a_meta_built_llama_under_zero_bubble(tmp_path, reference):
    # peft's layers built on meta, materialised on cuda:0, traced into a V whose backward splits input from weight
    # gradients: the frozen base bit-exact, the adapters as one GPU moves them
    cfg = dict(LORA, **{k: CUDA[k] for k in ("accelerator", "sanity", "timeout")}, schedule="zbv", devices=1, m=4)
    job = pipelined(cfg, tmp_path)
    assert job.rank(0)["meta_params"] == 0 and job.rank(0)["param_devices"] == ["cuda:0"]
    ref = reference(**_micro(cfg))
    state = job.state()
    assert_state_equal(state, ref["state"], PARAM_TOL)
    assert all(torch.equal(v, ref["initial"][k]) for k, v in state.items() if ".lora_" not in k)
    assert_same_logs(job.rank(0), reference(**common(cfg)), LOSS_TOL)


def ranks(*counts: int) -> pytest.MarkDecorator:
    """Run on as many GPUs as each count, where the machine has them (the machines lent so far had one)."""
    return pytest.mark.parametrize("devices", [pytest.param(n, marks=gpus(n), id=f"{n}gpu") for n in counts])


@ranks(1, 2)
def test_auto_measures_a_module_built_on_the_cpu_on_the_gpu_it_trains_on(devices, tmp_path, reference, monkeypatch):
    monkeypatch.setenv("LIGHTNING_PP_CACHE", str(tmp_path / "cache"))  # measured here, not read from another test's
    cfg = dict(CUDA, schedule="auto", devices=devices)
    job = pipelined(cfg, tmp_path)
    assert "the first batch's costs (the module moved to cuda:0 for it)" in job.output
    for r in range(devices):
        assert job.rank(r)["param_devices"] == [f"cuda:{r}"]
    m = job.rank(0)["chosen"]["n_microbatches"]
    ref = reference(**{**common(cfg), "batch": cfg["batch"] // m, "accumulate": m})
    assert_state_equal(job.state(), ref["state"], PARAM_TOL)


@ranks(1, 2)
def test_a_meta_built_model_is_materialised_on_each_rank_s_device(devices, tmp_path, reference):
    cfg = dict(CUDA, model="init", build="init_module", devices=devices, m=2)
    job = pipelined(cfg, tmp_path)
    for r in range(devices):
        assert job.rank(r)["meta_params"] == 0 and job.rank(r)["param_devices"] == [f"cuda:{r}"]
    ref = reference(**common(cfg))  # the same build, materialised by the pipeline's rule
    assert_same_logs(job.rank(0), ref, LOSS_TOL)


@gpus(4)
def test_fsdp_inside_stages_trains_as_one_gpu(tmp_path, reference):
    cfg = dict(CUDA, devices=4, pp=2, data_parallel="fsdp", schedule="1f1b", m=2, sync_dist=True, max_steps=6)
    job = pipelined(cfg, tmp_path)
    ref = reference(**combined(cfg))
    assert_same_logs(job.rank(0), ref, LOSS_TOL)
    assert_state_equal(job.state(), ref["state"], PARAM_TOL)


@gpus(2)
@pytest.mark.parametrize("precision", ["16-mixed", "bf16-mixed"])
def test_mixed_precision_on_cuda_trains_as_one_gpu(precision, tmp_path, reference):
    # 16-mixed: Lightning's CUDA GradScaler, one scale for every stage
    cfg = dict(CUDA, schedule="gpipe", devices=2, m=2, precision=precision)
    job = pipelined(cfg, tmp_path)
    ref = reference(**common(cfg))
    assert_same_logs(job.rank(0), ref, 5e-3)  # half-precision activations: the tolerance of one rounding
    if precision == "16-mixed":
        assert job.rank(0)["scale"] == job.rank(1)["scale"] == ref["scale"]


@gpus(2)
def test_2bw_on_cuda_follows_its_one_gpu_semantics(tmp_path, reference):
    cfg = dict(CUDA, model="tiny", devices=2, m=4, optimizer="sgd", lr=0.05, n_train=64)
    ref = reference(**cfg, reference_2bw=True)
    job = pipelined({**cfg, "schedule": "2bw"}, tmp_path)
    assert_follows(job, 2, ref)


@gpus(2)
def test_the_timeline_is_timed_with_cuda_events(tmp_path):
    job = pipelined(dict(CUDA, schedule="1f1b", devices=2, m=4, batch=32, n_train=128, monitor_pipeline=True), tmp_path)
    trace = json.loads((job.out / "pipeline_trace.json").read_text())
    for stage in range(2):
        compute = [e for e in trace["traceEvents"] if e["tid"] == stage and e["cat"] in ("forward", "backward")]
        assert len(compute) == 8 and all(e["dur"] > 0 for e in compute)
    bubbles = [r["pipeline/bubble"] for r in job.rank(0)["logged"] if "pipeline/bubble" in r]
    assert bubbles and all(0 < b < 1 for b in bubbles)


@gpus(1)
@pytest.mark.parametrize("ranks, schedule", [(1, "zbv"), (2, "1f1b")])
def test_generation_on_cuda_makes_one_gpu_s_tokens(ranks, schedule, tmp_path_factory):
    # one GPU: a V's four stages handed over on the device; two: the hidden states and tokens over NCCL; the
    # sampling generator on CUDA against torch.manual_seed and Hugging Face's generate on one GPU
    if GPUS < ranks:
        pytest.skip(f"needs {ranks} CUDA devices, this machine has {GPUS}")
    case = {"model": "llama", "split": "trace", "schedule": schedule, "name": "llama"}
    out, reference = generate_job_against_one_process(tmp_path_factory, ranks, [case], accelerator="cuda")
    same_as_one_process(out, reference, "llama", ranks)
