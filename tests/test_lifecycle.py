"""validate/test before and after fit in one process, the pruned module's error, launch by torchrun."""

from __future__ import annotations

import json
import os
import sys

import lifecycle_job
from conftest import HERE, ok, run_job, run_module
from test_parity import LOSS_TOL, assert_same_logs


def test_validate_test_fit_in_any_order_in_one_process(tmp_path):
    out = tmp_path / "pipe"
    # python -m lifecycle_job: its first process forked (imports done), Lightning's launcher starts rank 1
    cfg = json.dumps({"out": str(out), "devices": 2, "pipeline": True})
    proc = run_module("lifecycle_job", [cfg], tmp_path, timeout=240, env={"PYTHONPATH": str(HERE)})
    assert proc.returncode == 0, (proc.stdout + proc.stderr)[-4000:]
    ref = lifecycle_job.run({"out": str(tmp_path / "ref"), "threads": 1})
    for rank in range(2):
        got = json.loads((out / f"rank{rank}.json").read_text())
        for key in ("validate_first", "test_first", "fit_val", "test_after", "validate_after"):
            assert abs(got[key] - ref[key]) <= LOSS_TOL, (rank, key, got[key], ref[key])
        assert got["validate_first"] != got["validate_after"]  # fit trained in between
        # after fit each rank holds one stage and says so when called outside the pipeline
        assert f"holds only pipeline stage {rank} of 2" in got["call"] and "load_from_checkpoint" in got["call"]
        assert got["threads"] == max(1, os.cpu_count() // 2)
    # rank 0 logs the placement once, for the first pipelined call
    log = proc.stdout + proc.stderr
    assert log.count("Pipeline placement (2 stages, layers at 'net.blocks'):") == 1
    assert "stage 0: layers b0..b1 (2), parts ['criterion', 'net.embed', 'net.pos']" in log
    assert "stage 1: layers b2..b3 (2), parts ['final_norm', 'criterion', 'net.head']" in log


def test_torchrun_launch_matches_one_process(tmp_path, reference):
    cfg = dict(schedule="1f1b", devices=2, m=2, batch=8, n_train=32)
    command = [
        sys.executable,
        "-m",
        "torch.distributed.run",
        "--standalone",
        "--nproc_per_node",
        "2",
        str(HERE / "job.py"),
    ]
    job = ok(run_job({**cfg, "strategy": "pipeline"}, tmp_path / "job", timeout=240, command=command))
    ref = reference(batch=8, n_train=32)
    for rank in range(2):
        assert job.rank(rank)["world"] == 2 and job.rank(rank)["threads"] == 1
    assert_same_logs(job.rank(0), ref, LOSS_TOL)
