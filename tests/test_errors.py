"""Bad input fails fast with the fix named; a failing or dying rank ends the whole job."""

from __future__ import annotations

import subprocess
import sys
import textwrap
import time

import pytest
import torch
from conftest import child_env, run_job
from job import process_running
from models import MOE, TinyGPT

from lightning_pp import PipelineConfigError, PipelineStrategy
from lightning_pp.compat import _refuse_an_older_torch
from lightning_pp.layout.mesh import make_layout
from lightning_pp.runtime.twobw import check_optimizers, look_ahead
from lightning_pp.split.experts import route_experts
from lightning_pp.split.planning import check_module, check_training_setup


class _Unsized(torch.utils.data.IterableDataset):
    def __iter__(self):
        return iter(range(4))


@pytest.mark.parametrize("version", ["2.11.0+cu130", "2.12.1", "2.13.0a0+git1234", "2.13.0+cpu", "2.15.1"])
def test_a_supported_torch_is_accepted(version):
    _refuse_an_older_torch(version)


def test_a_torch_older_than_2_11_is_refused_at_import_naming_it_and_the_range():
    # 2.10's pipelining lacks what the package builds on; refused at import, not in the first step
    with pytest.raises(ImportError, match=r"this environment has torch 2\.10\.0\+cu128.*'torch>=2\.11,<2\.16'"):
        _refuse_an_older_torch("2.10.0+cu128")


@pytest.mark.parametrize(
    "kwargs,error,match",
    [
        (dict(schedule="pipedream"), PipelineConfigError, r"Unknown schedule='pipedream'; valid schedules are"),
        (dict(schedule="gpipe", stages_per_rank=2), PipelineConfigError, r"one stage per rank, but stages_per_rank=2"),
        (dict(schedule="ZBV", stages_per_rank=3), PipelineConfigError, r"exactly two stages per rank"),
        (dict(schedule="looped_bfs", stages_per_rank=0), PipelineConfigError, r"stages_per_rank=0 must be a positive"),
        (dict(state_dict_type="distributed"), PipelineConfigError, r"Unknown state_dict_type='distributed'"),
        (dict(balance="speed"), ValueError, r"Unknown balance='speed'"),
        (dict(n_microbatches=0), PipelineConfigError, r"n_microbatches=0 must be a positive integer"),
        (dict(data_parallel="zero3"), PipelineConfigError, r"Unknown data_parallel='zero3'; use 'ddp' .* or 'fsdp'"),
        (dict(data_parallel="fsdp", fsdp_reshard="layer"), PipelineConfigError, r"Unknown fsdp_reshard='layer'"),
        (
            dict(data_parallel="fsdp", fsdp_reshard="microbatch", schedule="zbv"),
            PipelineConfigError,
            r"fsdp_reshard='microbatch' with schedule='zbv'.*Use fsdp_reshard='step'",
        ),
        (dict(split="trace", tensor_parallel_size=2), PipelineConfigError, r"split='trace' with tensor_parallel_size"),
        (dict(tensor_parallel_size=0), PipelineConfigError, r"tensor_parallel_size=0 must be a positive integer"),
        (dict(schedule="2bw", stages_per_rank=2), PipelineConfigError, r"one stage per rank, but stages_per_rank=2"),
        (dict(schedule="pipedream_2bw", data_parallel="fsdp"), PipelineConfigError, r"'2bw' with data_parallel='fsdp'"),
        (dict(schedule="2bw", split="trace"), PipelineConfigError, r"schedule='2bw' with split='trace' is not"),
        (dict(schedule="2bw", activation_checkpointing=True), PipelineConfigError, r"with activation_checkpointing"),
        (dict(compile=True, schedule="zbv"), PipelineConfigError, r"compile=True with schedule='zbv'.*'1f1b'"),
        (dict(compile=True, schedule="2bw"), PipelineConfigError, r"schedule='2bw' with compile=True is not"),
        (dict(compile={"modes": "max"}), PipelineConfigError, r"\['modes'\] are not torch.compile arguments"),
        (dict(expert_parallel_size=0), PipelineConfigError, r"expert_parallel_size=0 must be a positive integer"),
        (dict(expert_parallel_size=2, data_parallel="fsdp"), PipelineConfigError, r"with data_parallel='fsdp' is"),
        (dict(expert_parallel_size=2, tensor_parallel_size=2), PipelineConfigError, r"with tensor_parallel_size=2"),
        (dict(expert_parallel_size=2, schedule="2bw"), PipelineConfigError, r"expert_parallel_size=2 with schedule"),
    ],
)
def test_constructor_rejects_bad_arguments(kwargs, error, match):
    with pytest.raises(error, match=match):
        PipelineStrategy(**kwargs)


def test_checks_before_the_first_batch():
    model = TinyGPT(n_layers=4)
    with pytest.raises(
        PipelineConfigError,
        match=r"4 layers but the pipeline has 5 stages.*at most 4 stages \(pipeline ranks x stages_per_rank",
    ):
        check_module(model, "net.blocks", None, 5)
    with pytest.raises(ValueError, match=r"balance=\[1, 2\] sums to 3 but the model has 4 layers"):
        check_module(model, "net.blocks", [1, 2], 2)
    with pytest.raises(ValueError, match=r"has 3 entries but the pipeline has 2 stages"):
        check_module(model, "net.blocks", [1, 2, 1], 2)
    with pytest.raises(PipelineConfigError, match=r"layers='blocks'"):
        check_module(model, "blocks", None, 2)
    with pytest.raises(PipelineConfigError, match=r"n_microbatches=2 and there are 4 stages"):
        check_training_setup(model, "1f1b", 2, make_layout(4, 4, 0))
    with pytest.raises(PipelineConfigError, match=r"n_microbatches=3 and there are 4 stages"):
        check_training_setup(model, "dualpipev", 3, make_layout(2, 2, 0, "dualpipev", 2))
    with pytest.raises(PipelineConfigError, match=r"schedule='2bw' needs n_microbatches >= stages"):
        check_training_setup(model, "2bw", 3, make_layout(4, 4, 0))
    with pytest.raises(PipelineConfigError, match=r"returned 2 optimizers; return one"):
        check_optimizers("2bw", [object(), object()])
    unsized = torch.utils.data.DataLoader(_Unsized())
    with pytest.raises(PipelineConfigError, match=r"'2bw' needs a train loader with a length, got DataLoader"):
        look_ahead(unsized, "2bw", training=True)
    assert look_ahead(unsized, "1f1b", training=True) is unsized
    wrapped = TinyGPT(n_layers=4)
    wrapped.net.blocks = torch.compile(wrapped.net.blocks)
    with pytest.raises(PipelineConfigError, match=r"torch.compile's wrapper of the layer container.*compile=True"):
        check_module(wrapped, "net.blocks", None, 2)
    compiled = TinyGPT(n_layers=4)
    for target, name in ((compiled.net, "net"), (compiled, "the LightningModule"), (compiled.net.blocks, "net.blocks")):
        target.compile()
        with pytest.raises(PipelineConfigError, match=rf"^{name} was compiled as a whole.*compile=True"):
            check_module(compiled, "net.blocks", None, 2)
        target._compiled_call_impl = None
    per_block = TinyGPT(n_layers=4)
    for block in per_block.net.blocks.values():
        block.compile()
    check_module(per_block, "net.blocks", None, 2)  # a user's per-block compile is how it is done
    model.automatic_optimization = False
    with pytest.raises(PipelineConfigError, match=r"manual optimization"):
        check_training_setup(model, "1f1b", 4, make_layout(2, 2, 0))
    with pytest.raises(PipelineConfigError, match=r"pipeline_parallel_size=3 does not divide the world size 4"):
        make_layout(3, 4, 0)
    with pytest.raises(PipelineConfigError, match=r"tensor_parallel_size=3 does not divide the world size 4"):
        make_layout(None, 4, 0, tensor_parallel_size=3)
    with pytest.raises(PipelineConfigError, match=r"pipeline_parallel_size=4 x tensor_parallel_size=2 does not divide"):
        make_layout(4, 4, 0, tensor_parallel_size=2)
    with pytest.raises(PipelineConfigError, match=r"expert_parallel_size=4 with 2 pipeline replica\(s\) \(8 ranks / 4"):
        make_layout(4, 8, 0, expert_parallel_size=4)
    assert make_layout(4, 8, 0, expert_parallel_size=2).dp == 2
    with pytest.raises(PipelineConfigError, match=r"expert_parallel_size=2, but TinyGPT holds no experts module"):
        route_experts(model, 2)
    mixtral = MOE["mixtral"](n_layers=1)  # 4 experts
    with pytest.raises(PipelineConfigError, match=r"cannot shard model.model.layers.0.mlp.experts .* 4 experts\."):
        route_experts(mixtral, 3)
    assert route_experts(mixtral, 2) == ["model.model.layers.0.mlp.experts"]
    layout = make_layout(2, 8, 5, tensor_parallel_size=2)  # (replica, stage, shard) = (1, 0, 1)
    assert (layout.dp, layout.replica, layout.pp_rank, layout.tp_rank, layout.last_stage_rank) == (2, 1, 0, 1, 7)
    assert layout.pipeline_ranks(1) == [5, 7] and not layout.writes_full_checkpoint


def assert_all_ranks_gone(out, n: int) -> None:
    deadline = time.monotonic() + 10
    pids = [int((out / f"pid{r}").read_text()) for r in range(n) if (out / f"pid{r}").exists()]
    assert len(pids) == n
    while any(process_running(p) for p in pids) and time.monotonic() < deadline:
        time.sleep(0.2)
    assert not any(process_running(p) for p in pids)


def test_forward_that_does_not_skip_none_stops_every_rank_with_the_message(tmp_path):
    job = run_job(dict(strategy="pipeline", devices=2, m=2, model="noskip", timeout=30), tmp_path / "job", timeout=90)
    assert job.returncode != 0
    assert job.seconds < 60
    # rank 1 fails in its forward; rank 0 stops with rank 1's message instead of hanging
    assert "'NoneType' object is not callable" in job.output
    assert "Pipeline rank 1 failed, so rank 0 stops too" in job.output
    assert "forward must skip parts that are None" in job.output and "split='trace'" in job.output
    assert_all_ranks_gone(job.out, 2)


def test_a_forward_that_pruned_stages_run_to_another_result_is_refused_on_every_rank(tmp_path):
    # enumerate(self.net.blocks) counts a stage's blocks from 0: pruned, it would train silently otherwise
    job = run_job(
        dict(strategy="pipeline", devices=2, m=2, model="counting", split="prune", timeout=30), tmp_path / "j"
    )
    assert job.returncode != 0
    said = "forward's result run stage by stage differs from its result whole (by up to"
    assert job.output.count(said) >= 2 and "pass split='trace'" in job.output, job.output[-3000:]


def test_a_step_that_calls_the_model_twice_is_refused_on_every_rank(tmp_path):
    job = run_job(
        dict(strategy="pipeline", devices=2, m=2, model="twice", sanity=0, timeout=30), tmp_path / "job", timeout=90
    )
    assert job.returncode != 0 and job.seconds < 60
    assert "TwiceGPT.training_step calls the model more than once" in job.output
    assert "Pipeline rank 1 failed, so rank 0 stops too" in job.output
    assert_all_ranks_gone(job.out, 2)


def test_batch_that_does_not_split_fails_on_every_rank_before_training(tmp_path):
    job = run_job(dict(strategy="pipeline", devices=2, m=3, batch=8, timeout=30), tmp_path / "job", timeout=90)
    assert job.returncode != 0 and job.seconds < 60
    message = "batch_size=8 has 8 samples, which does not split into n_microbatches=3 equal parts"
    assert job.output.count(message) >= 2, job.output[-3000:]
    assert_all_ranks_gone(job.out, 2)


def test_partial_last_batch_that_cannot_split_is_reported_before_training(tmp_path):
    job = run_job(
        dict(strategy="pipeline", devices=2, m=4, batch=8, n_train=66, sanity=0, timeout=30),
        tmp_path / "job",
        timeout=90,
    )
    assert job.returncode != 0 and job.seconds < 60
    assert job.output.count("The last training batch (66 samples, batch_size=8) has 2 samples") >= 2
    assert not (tmp_path / "job" / "rank0.json").exists()


def test_a_killed_rank_ends_the_job(tmp_path):
    cfg = dict(strategy="pipeline", devices=2, m=2, kills={"0": [1, 2, "start"]}, timeout=30)
    job = run_job(cfg, tmp_path / "job", timeout=90, launcher=True)
    assert job.returncode != 0 and job.seconds < 60
    assert_all_ranks_gone(job.out, 2)


@pytest.mark.parametrize(
    "stopped, message",
    [
        (1, "Pipeline ranks [1] stopped answering (their processes are alive but do not run"),
        (0, "Pipeline rank 0 stopped or died: the job's store, which it hosts, has not answered"),
    ],
)
def test_a_stopped_rank_ends_the_job_within_the_timeout_and_is_named(tmp_path, stopped, message):
    # a rank stopped (SIGSTOP), not killed, closes no connection: its peer's receive times out after 4 s
    cfg = dict(strategy="pipeline", devices=2, m=2, kills={"0": [stopped, 3, "start", "STOP"]}, timeout=4)
    job = run_job(cfg, tmp_path / "job", timeout=90)
    assert job.returncode != 0
    assert message in job.output, job.output[-3000:]
    # the other rank gave up within the timeout and the naming (heartbeats, or the store's silence), then the
    # stopped rank was killed as a launcher kills the rest of a failed job
    assert float((tmp_path / "job" / "stopped").read_text()) < 4 + 12


SLOW_BEAT = """
    import time
    from datetime import timedelta
    import torch.distributed as dist
    from lightning_pp.lifecycle import heartbeat

    class Slow:  # each round trip takes 0.3 s (a loaded or distant store host), in C++ with the GIL released
        def __init__(self, store):
            self.store = store

        def add(self, key, n):
            try:
                self.store.wait(["never"], timedelta(seconds=0.3))
            except dist.DistStoreError:
                pass
            return self.store.add(key, n)

    heartbeat._INTERVAL_S = (0.01, 0.01)
    store = dist.TCPStore("127.0.0.1", 0, 1, is_master=True, timeout=timedelta(seconds=5))
    heartbeat.start_heartbeat(Slow(store), 0, timedelta(seconds=1))
    time.sleep(0.1)
    raise RuntimeError("the job's own error")
"""


def test_an_exit_during_a_heartbeat_store_call_keeps_the_jobs_exit_status():
    # a daemon thread coming back from a store call while the interpreter shuts down aborted the process
    # (SIGABRT, "terminate called without an active exception") instead of exiting 1 with the error
    proc = subprocess.run(
        [sys.executable, "-c", textwrap.dedent(SLOW_BEAT)],
        env=child_env(), capture_output=True, text=True, timeout=60, check=False,
    )  # fmt: skip
    assert proc.returncode == 1, proc.stderr[-3000:]
    assert "the job's own error" in proc.stderr and "terminate called" not in proc.stderr


def test_the_heartbeat_counts_in_each_new_jobs_store():
    # a process that runs jobs in turn (a sweep's rank 0, the planner's runs under one torchrun) makes a process
    # group, and a store, per job: its counter kept beating in the first job's, and a timed-out step of a later
    # job read that job's peers as stopped
    from datetime import timedelta

    import torch.distributed as dist

    from lightning_pp.lifecycle import heartbeat

    def count(store: dist.Store) -> int:
        return store.add("lightning_pp/beat/0", 0)

    stores = [dist.TCPStore("127.0.0.1", 0, 1, is_master=True, timeout=timedelta(seconds=5)) for _ in range(2)]
    try:
        for store in stores:
            heartbeat.start_heartbeat(store, 0, timedelta(seconds=1))  # a beat every 0.2 s
            time.sleep(0.5)
        before = [count(store) for store in stores]
        time.sleep(0.5)
        after = [count(store) for store in stores]
        assert after[0] == before[0] and after[1] > before[1] > 0, (before, after)
    finally:
        if heartbeat._running is not None:
            heartbeat._running.stop()
        heartbeat._running = None
