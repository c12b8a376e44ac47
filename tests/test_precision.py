"""16-mixed under the pipeline: one loss scale and one skip verdict on every rank, as one process has them.

The jobs use Lightning's ``MixedPrecision("16-mixed", "cpu")`` plugin (real fp16 autocast and a CPU
GradScaler, initial scale 1024 unless
``init_scale``, growth every 4 clean steps); ``inf_step`` makes the first layer's
gradients inf on global rank 0 only, which holds the first stage.
"""

from __future__ import annotations

import inspect

import pytest
import torch
from conftest import ok, run_job
from lightning.pytorch.plugins.precision import MixedPrecision
from test_parity import assert_same_logs, common

from lightning_pp import PipelineConfigError
from lightning_pp.runtime.precision import loss_multiplier, pipeline_precision

FP16_TOL = 1e-2
FP16 = dict(precision="16-mixed-cpu", sanity=0, n_val=16)


class Scaler:
    """Not a torch GradScaler."""

    def scale(self, loss: torch.Tensor) -> torch.Tensor:
        return loss * 4


def test_the_scaler_hook_keeps_its_signature_and_the_plugin_its_checkpoint_key():
    # the one private torch method the shared verdict overrides
    params = list(inspect.signature(torch.amp.GradScaler._unscale_grads_).parameters)
    assert params == ["self", "optimizer", "inv_scale", "found_inf", "allow_fp16"]
    plugin = MixedPrecision("16-mixed", "cpu", scaler=torch.amp.GradScaler("cpu", init_scale=8.0))
    pipeline_precision(plugin, None, torch.device("cpu"))
    # Lightning saves the scaler under type(plugin).__qualname__: a one-process checkpoint uses the same key
    assert type(plugin).__qualname__ == "MixedPrecision" and isinstance(plugin, MixedPrecision)
    assert type(plugin.scaler).__qualname__ == "GradScaler" and loss_multiplier(plugin) == 8.0
    # a rank whose stage got no gradients still unscales, votes and steps without error
    weight = torch.nn.Parameter(torch.ones(2))
    optimizer = torch.optim.SGD([weight], lr=1.0)
    plugin.scaler.unscale_(optimizer)
    plugin.scaler.step(optimizer)
    plugin.scaler.update()
    assert torch.equal(weight, torch.ones(2)) and plugin.scaler.get_scale() == 8.0
    # a scaler the pipeline cannot put into the last stage's loss is refused, not ignored
    with pytest.raises(PipelineConfigError, match=r"MixedPrecision.scaler is a Scaler.*torch.amp.GradScaler"):
        pipeline_precision(MixedPrecision("16-mixed", "cpu", scaler=Scaler()), None, torch.device("cpu"))


def scales_and_skips(job, ranks: int, ref: dict, skipped: int | None) -> None:
    """Every rank's loss scale after each step equals one process's, and every rank skipped the same step."""
    for r in range(ranks):
        rank = job.rank(r)
        assert rank["scales"] == ref["scales"], (r, rank["scales"], ref["scales"])
        assert rank["moved"] == ref["moved"], (r, rank["moved"], ref["moved"])
        if skipped is not None:
            assert [i for i, m in enumerate(ref["moved"]) if not m] == [skipped]


@pytest.fixture(scope="module")
def first_run(tmp_path_factory, reference):
    """1F1B on 2 stages with clipping; stage 0's gradients overflow at step 5 of 7."""
    cfg = dict(FP16, schedule="1f1b", devices=2, m=4, batch=8, n_train=56, clip=0.5, inf_step=5)
    job = ok(run_job({**cfg, "strategy": "pipeline"}, tmp_path_factory.mktemp("fp16") / "job", timeout=240))
    return cfg, job, reference(**common(cfg))


def test_an_overflow_on_one_stage_skips_the_step_on_every_rank(first_run):
    cfg, job, ref = first_run
    assert_same_logs(job.rank(0), ref, FP16_TOL)
    scales_and_skips(job, 2, ref, skipped=5)
    # doubled after 4 clean steps, halved by the overflow, as one process does
    assert ref["scales"] == [1024.0] * 3 + [2048.0] * 2 + [1024.0] * 2
    # the scaler's state sits under the key a one-process checkpoint uses
    ckpt = torch.load(job.out / "final.ckpt", weights_only=False)
    expected = torch.load(ref["out"] / "final.ckpt", weights_only=False)["MixedPrecision"]
    assert ckpt["MixedPrecision"] == expected and expected["_growth_tracker"] == 1


def test_the_scale_resumes_under_another_layout_and_on_one_process(first_run, tmp_path, reference):
    _, first, _ = first_run
    # GPipe on 3 stages with clipping, resumed from the 2-stage checkpoint; one process resumes from it too
    cfg = dict(FP16, schedule="gpipe", devices=3, m=3, batch=6, n_train=36, clip=0.5, max_epochs=2, init_scale=64.0)
    cfg["n_val"] = 18
    cfg["resume"] = str(first.out / "final.ckpt")
    job = ok(run_job({**cfg, "strategy": "pipeline"}, tmp_path / "job", timeout=240))
    ref = reference(**common(cfg))
    assert_same_logs(job.rank(0), ref, FP16_TOL)
    scales_and_skips(job, 3, ref, skipped=None)
    # scale 1024 and one clean step carried over (not init_scale=64): it doubles after the third step
    assert ref["scales"][:4] == [1024.0, 1024.0, 2048.0, 2048.0]


def test_zero_bubble_v_schedule_with_replicas_accumulation_and_a_fused_optimizer(tmp_path):
    # 2 replicas x 2 ranks x 2 stages each, against Lightning's DDP on 2 processes under the same plugin
    cfg = dict(FP16, n_train=64, batch=4, accumulate=2, optimizer="fused_adamw", inf_step=1, sync_dist=True)
    job = ok(run_job({**cfg, "strategy": "pipeline", "schedule": "zbv", "devices": 4, "pp": 2, "m": 4,
                      "state_dict_type": "sharded"}, tmp_path / "job", timeout=300))  # fmt: skip
    ddp = ok(run_job({**cfg, "strategy": "ddp", "devices": 2}, tmp_path / "ddp"))
    ref = ddp.rank(0)
    assert_same_logs(job.rank(0), ref, FP16_TOL)
    scales_and_skips(job, 4, ref, skipped=1)
    assert ddp.rank(1)["scales"] == ref["scales"]
    # the sharded checkpoint: one shard per stage-holding rank of replica 0 (replica 1 writes nothing), the
    # scaler's state beside the other non-tensor state
    ckpt = job.out / "final.ckpt"
    assert sorted(p.name for p in ckpt.glob("*.distcp")) == ["__0_0.distcp", "__1_0.distcp"]
    assert torch.load(ckpt / "meta.pt", weights_only=False)["MixedPrecision"]["scale"] == ref["scales"][-1]


@pytest.mark.parametrize("precision", ["16-true", "bf16-true"])
def test_half_precision_weights_match_one_process(precision, tmp_path, reference):
    # the module cast to half: no scaler; plain SGD (Adam's eps underflows in fp16, in one process too)
    cfg = dict(precision=precision, schedule="gpipe", devices=2, m=2, batch=8, n_train=40, n_val=16, sanity=0)
    cfg.update(optimizer="plain_sgd", lr=0.5, clip=0.5)
    job = ok(run_job({**cfg, "strategy": "pipeline"}, tmp_path / "job", timeout=240))
    ref = reference(**common(cfg))
    assert_same_logs(job.rank(0), ref, FP16_TOL if precision == "16-true" else 2e-2)  # bf16: 1 ulp at 4 is 1.6e-2
    state = job.state()
    assert {v.dtype for v in state.values()} == {ref["state"]["net.head.weight"].dtype} != {torch.float32}
