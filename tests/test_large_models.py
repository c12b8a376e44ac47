"""Models larger than one device: built on meta, each rank materialises, initialises and reads only its
own stage; the results equal one process that built the same module and materialised it whole."""

from __future__ import annotations

import re
import subprocess
import sys

import pytest
from conftest import ok, run_job, run_script
from test_errors import assert_all_ranks_gone
from test_parity import LOSS_TOL, assert_same_logs
from torch.distributed.checkpoint import FileSystemReader

from lightning_pp.consolidate import consolidate

DATA = dict(model="init", batch=8, n_train=32, n_val=16)
MiB = 2**20


def held_only_its_stage(job, ranks: int, whole: list[str]) -> None:
    held = [set(job.rank(r)["params"]) for r in range(ranks)]
    assert set().union(*held) == set(whole)
    assert sum(len(h) for h in held) == len(whole)  # no parameter on two ranks
    for r in range(ranks):
        assert job.rank(r)["meta_params"] == 0  # everything a rank holds is materialised


def test_meta_built_model_trains_as_one_process_at_two_and_four_stages(tmp_path, reference):
    ref = reference(**DATA, build="init_module")
    two = ok(run_job({**DATA, "strategy": "pipeline", "devices": 2, "schedule": "gpipe", "m": 2,
                      "build": "configure_model"}, tmp_path / "two"))  # fmt: skip
    four = ok(run_job({**DATA, "strategy": "pipeline", "devices": 4, "schedule": "1f1b", "m": 4,
                       "build": "init_module", "balance": "profile"}, tmp_path / "four"))  # fmt: skip
    assert "GFLOP, counted on meta" in four.output  # balance="profile" without materialising the whole model
    for job, ranks in ((two, 2), (four, 4)):
        assert_same_logs(job.rank(0), ref, LOSS_TOL)
        held_only_its_stage(job, ranks, ref["params"])
    losses = [[r["train_loss"] for r in job.rank(0)["logged"] if "train_loss" in r] for job in (two, four)]
    assert max(abs(a - b) for a, b in zip(*losses)) <= 1e-5, losses


def test_each_rank_holds_only_its_stage_in_memory(tmp_path):
    # 24 layers of 1024 (385 MiB), 4 stages, SGD, no allocator variables (lightning_pp.memory.allocator), torch's
    # kernels paged in first: a rank's peak is its stage's parameters and gradients plus a few MiB of Lightning
    # and gloo, one layer's gradient while micro-batches accumulate, and the micro-batches' activations in flight.
    cfg = dict(model="init", build="init_module", dim=1024, n_layers=24, optimizer="plain_sgd", batch=8, n_train=16,
               n_val=8, sanity=0, max_steps=2, strategy="pipeline", devices=4, m=4, page_in=True)  # fmt: skip
    job = ok(run_job(cfg, tmp_path / "job"))
    whole = job.rank(0)["whole_bytes"]
    assert whole > 380 * MiB
    for r in range(4):
        rank = job.rank(r)
        stage = 2 * rank["param_bytes"]  # parameters and gradients
        assert 0.2 < rank["param_bytes"] / whole < 0.3
        print(f"rank {r}: peak growth {rank['peak_growth'] / whole:.3f} of the model")
        assert 0.95 * stage <= rank["peak_growth"] <= min(stage + 40 * MiB, 0.6 * whole), (r, rank["peak_growth"])


def _local_bytes(ckpt, names: set[str]) -> int:
    """Bytes of the checkpoint's tensors that belong to these parameters (weights and optimizer state)."""
    metadata = FileSystemReader(ckpt).read_metadata()
    total = 0
    for key, entry in metadata.state_dict_metadata.items():
        where = metadata.planner_data[key]
        name = where[1] if where[0] == "model" else where[3] if where[0] == "optimizers" else None
        if name in names and hasattr(entry, "size"):
            total += entry.size.numel() * entry.properties.dtype.itemsize
    return total


def test_sharded_checkpoint_resumes_under_another_layout_reading_only_local_bytes(tmp_path, reference):
    base = dict(DATA, n_train=64, dim=512, sanity=0, max_epochs=3, state_dict_type="sharded")
    first = ok(run_job({**base, "strategy": "pipeline", "devices": 2, "schedule": "gpipe", "m": 2, "max_steps": 4,
                        "build": "init_module"}, tmp_path / "first"))  # fmt: skip
    ckpt = first.out / "final.ckpt"
    job = ok(run_job({**base, "strategy": "pipeline", "devices": 4, "schedule": "1f1b", "m": 4, "max_steps": 8,
                      "build": "configure_model", "resume": str(ckpt), "test": True, "validate_ckpt": True},
                     tmp_path / "resumed"))  # fmt: skip
    shards = sum(f.stat().st_size for f in ckpt.glob("*.distcp"))
    for r in range(4):
        rank = job.rank(r)
        own = _local_bytes(ckpt, set(rank["params"]))
        # its own tensors, plus the checkpoint's metadata and what any first batch reads (~0.4 MiB of Python
        # modules) and a few KiB of headers per tensor; never another stage's tensors
        assert own <= rank["read_first_batch"] <= own + (ckpt / ".metadata").stat().st_size + 2 * MiB, r
        assert rank["read_first_batch"] < shards / 2
    full = consolidate(ckpt, tmp_path / "full.ckpt")
    ref = reference(**{k: v for k, v in base.items() if k != "state_dict_type"}, build="init_module", max_steps=8,
                    resume=str(full))  # fmt: skip
    got = [r["train_loss"] for r in job.rank(0)["logged"] if "train_loss" in r and r["step"] >= 4]
    expected = [r["train_loss"] for r in ref["logged"] if "train_loss" in r and r["step"] >= 4]
    assert len(got) == len(expected) == 4 and max(abs(a - b) for a, b in zip(got, expected)) <= LOSS_TOL
    # a fresh meta-built module validated from the checkpoint equals the trained one
    for r in range(4):
        assert job.rank(r)["validate_ckpt"]["val_loss"] == pytest.approx(job.rank(r)["validate"]["val_loss"], abs=1e-6)


@pytest.mark.parametrize(
    "model,message",
    [
        ("item", "cannot run without data (in ItemGPT.forward itself: RuntimeError: Tensor.item() cannot be called"),
        ("tiny", "no initialiser: 'net' (Net: ['pos'])"),
    ],
)
def test_a_module_that_cannot_be_built_on_meta_stops_every_rank_with_the_fix(tmp_path, model, message):
    job = run_job(dict(strategy="pipeline", devices=2, m=2, model=model, build="init_module", timeout=30),
                  tmp_path / "job", timeout=90)  # fmt: skip
    assert job.returncode != 0 and job.seconds < 60
    assert job.output.count(message) >= 2, job.output[-3000:]  # on both ranks
    assert_all_ranks_gone(job.out, 2)


HEAP_PROGRAM = """
import torch
from torch import nn
from lightning_pp.memory import allocator

class Stage:  # what allocator.trim_before_backward reads of torch's PipelineStage
    def __init__(self, weights):
        self.submod = nn.Linear(weights, 1024, bias=False)
    def backward_one_chunk(self, microbatch):
        return rss()
    def backward_weight_one_chunk(self, microbatch):
        return rss()

def rss():
    return int(next(l for l in open("/proc/self/status") if l.startswith("VmRSS:")).split()[1]) * 1024

allocator.return_freed_tensors(torch.device("cpu"))
small, large = Stage(1024), Stage(32 * 1024)  # 4 and 128 MiB of weights
for stage in (small, large):
    allocator.trim_before_backward(stage)
# a forward's leftovers: every other 256 KiB activation freed (no free() can trim them: kept ones lie between)
kept, freed = [], []
for _ in range(64):
    freed.append(torch.ones(2**16))
    kept.append(torch.ones(2**16))
before = rss()
del freed
print(before - small.backward_one_chunk(0), before - large.backward_one_chunk(0))
"""


def test_the_heap_goes_back_before_a_backward_where_it_is_small_beside_the_weights():
    # 16 MiB of freed activations in the heap: kept beside 4 MiB of weights (activations dominate: the next forward
    # would fault every page in again), returned beside 128 MiB (a model larger than a device)
    out = subprocess.run([sys.executable, "-c", HEAP_PROGRAM], capture_output=True, text=True, check=True)
    beside_small, beside_large = map(int, out.stdout.split())
    assert beside_small < 2 * MiB < 12 * MiB < beside_large, (beside_small, beside_large)


SETTLE_PROGRAM = """
import sys, time
import lightning, torch
from lightning_pp.memory import allocator

def mapped_while_a_16_mib_tensor_lives():  # its own mapping only: a BLAS may map workspaces of its own meanwhile
    before = allocator._libc.mallinfo2().hblkhd
    x = torch.ones(2**22)
    return allocator._libc.mallinfo2().hblkhd - before

settle = sys.argv[1] != "limited"  # a memory_limit to keep
allocator.return_freed_tensors(torch.device("cpu"))
for _ in range(2):
    allocator.training_step_begins(settle)
third = mapped_while_a_16_mib_tensor_lives()
allocator.training_step_begins(settle)  # the third: measured
start = time.perf_counter()
if sys.argv[1] != "computing":  # mapped afresh at every micro-batch, as a 16 MiB weight gradient
    while time.perf_counter() - start < 0.5:
        torch.ones(2**22)
else:
    x = torch.ones(256, 256)
    while time.perf_counter() - start < 0.5:
        x @ x
allocator.training_step_begins(settle)  # the fourth
print("mapped", third, mapped_while_a_16_mib_tensor_lives(), flush=True)
"""


def test_the_heap_keeps_big_tensors_once_page_faults_cost_a_step(tmp_path):
    # a third step spent in page faults (4 MiB tensors and more mapped afresh each time): from the fourth step they
    # stay in the heap, and the rank says what that means for the user, unless a memory_limit is to be kept (the
    # rank says what the lean heap costs it); a step spent computing keeps them mapped (returned when freed)
    script = tmp_path / "settle.py"
    script.write_text(SETTLE_PROGRAM)
    for third_step in ("faulting", "limited", "computing"):
        code, output = run_script(script, 120, argv=[third_step])
        assert code == 0, output
        third, fourth = map(int, re.search(r"^mapped (\d+) (\d+)$", output, re.M).groups())  # a 16 MiB tensor's
        assert third >= 16 * MiB, output
        # the start-up line has nothing to act on (debug); the change says what it means for the user
        assert "glibc's mmap threshold fixed" not in output, output
        settled = "page faults and heap trims took" in output and "faster steps, a peak memory that may grow" in output
        kept = "freed tensors still go back to the OS, as memory_limit needs" in output
        if third_step == "faulting":
            assert third - fourth >= 15 * MiB, output  # the tensor no longer among the mapped blocks
            assert settled and not kept, output
        else:
            assert abs(third - fourth) < MiB, output
            assert not settled and kept == (third_step == "limited"), output
