"""The module shapes real models have: layers in an ``nn.ModuleList`` or ``nn.Sequential``, and a network
reached through wrappers (``forward`` delegating to an inner module), each equal to one process."""

from __future__ import annotations

import pytest
from conftest import ok, run_job
from test_parity import LOSS_TOL, assert_exact_parameters, assert_same_logs, common
from test_tied import assert_state_equal

SHAPES = {
    # the user's loop `for block in self.net.blocks` runs only the stage's blocks, under their global names
    "modulelist-2-1f1b": dict(model="list", schedule="1f1b", devices=2, m=2, optimizer="sgd", lr=0.5, params=True),
    # nn.Sequential's own forward over the pruned container
    "sequential-3-gpipe": dict(
        model="sequential",
        schedule="gpipe",
        devices=3,
        m=3,
        batch=6,
        n_train=36,
        n_val=30,
        optimizer="sgd",
        lr=0.5,
        params=True,
    ),  # fmt: skip
    # a V schedule: rank 0 holds stages 0 and 3, each a view of its one pruned ModuleList
    "modulelist-zbv-4": dict(model="list", schedule="zbv", devices=2, m=4),
    "sequential-interleaved-4": dict(model="sequential", schedule="interleaved_1f1b", devices=2, m=4),
    # a network that is one nn.Sequential of mixed layers, called by the step itself, given no layers= or split=
    "sequential-net-defaults-3": dict(
        model="sequential_net",
        layers=None,
        split=None,
        schedule="1f1b",
        devices=3,
        m=3,
        batch=6,
        n_train=36,
        n_val=30,
        optimizer="sgd",
        lr=0.5,
    ),  # fmt: skip
    # self(x) -> self.body(x) -> the ModuleList three levels down, on 3 stages
    "delegating-3-1f1b": dict(
        model="delegating", layers="body.net.blocks", schedule="1f1b", devices=3, m=3, batch=6, n_train=36, n_val=30
    ),  # fmt: skip
}


@pytest.mark.parametrize("name", list(SHAPES))
def test_module_shape_trains_as_one_process(name, tmp_path, reference):
    cfg = {"batch": 8, "n_train": 32, "n_val": 16, **SHAPES[name]}
    job = ok(run_job({**cfg, "strategy": "pipeline"}, tmp_path / "job", timeout=240))
    ref = reference(**common(cfg))
    assert_same_logs(job.rank(0), ref, LOSS_TOL)
    held = [set(job.rank(r)["params"]) for r in range(cfg["devices"])]
    assert set().union(*held) == set(ref["params"]) and sum(map(len, held)) == len(ref["params"])
    assert job.state().keys() == ref["state"].keys()  # every layer under its one-process name
    if cfg.get("params"):
        assert_exact_parameters(job, cfg, reference)
    if "split" in cfg:  # found: all 10 layers of 'net', each stage's part of it run by the Sequential's forward
        assert "Splitting 'net' into stages: 10 layers (Linear)" in job.output and "forward calls" not in job.output
        micro = reference(**{**common(cfg), "batch": cfg["batch"] // cfg["m"], "accumulate": cfg["m"]})
        assert_state_equal(job.state(), micro["state"], 1e-6)


def test_batchnorm_statistics_follow_the_microbatches(tmp_path, reference):
    # BatchNorm normalises by what it sees, a micro-batch: the pipeline equals one process stepping every m
    # micro-batches, running statistics included (updated once per micro-batch's forward, never by torch's shape
    # inference). Its blocks transpose their input, so the gradient a stage sends back is made contiguous.
    cfg = dict(model="batchnorm", schedule="1f1b", devices=2, m=2, batch=8, n_train=32, n_val=16, optimizer="sgd",
               lr=0.5)  # fmt: skip
    job = ok(run_job({**cfg, "strategy": "pipeline"}, tmp_path / "job", timeout=240))
    assert_exact_parameters(job, cfg, reference)
    state = job.state()
    assert int(state["net.blocks.b3.norm.num_batches_tracked"]) == 2 * 4  # 2 micro-batches in each of 4 steps
    assert job.output.count("BatchNorm layer(s) (net.blocks.b0.norm, net.blocks.b1.norm, net.blocks.b2.norm, ...)") == 1
