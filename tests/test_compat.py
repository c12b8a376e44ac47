"""``lightning_pp/compat.py``: each shim applies on the torch releases it names and nowhere else, and with them a
V whose stages hand on tensors that need no gradient (a traced model's position ids, its rotary table) and use a
layer twice trains as one process does, on every release (torch 2.11's own stage refuses the integers, 2.11 and
2.12's wait for gradients of them, and their split backward counts a weight gradient twice; ``scripts/compat.sh``
runs this file on each release)."""

from __future__ import annotations

import pickle
from collections import defaultdict

import pytest
import torch
import torch.multiprocessing as mp
from conftest import free_port
from torch import nn

from lightning_pp import compat

RELEASE = compat.RELEASE
# each shim: the releases whose stages it changes (the oldest and newest minor versions it covers)
COVERS = {
    "buffers_kept_through_metadata_inference": ((2, 11), (2, 13)),
    "shape_inference_uncompiled": ((2, 11), (2, 11)),
    "warm_up_without_self_sends": ((2, 11), (2, 11)),
    "non_floating_tensors_received": ((2, 11), (2, 11)),
    "no_gradient_for_tensors_that_need_none": ((2, 11), (2, 12)),
}
N_STAGES, M, DIM = 4, 4, 8


class Piece(nn.Module):
    """A stage: hidden states, token ids and a table made from them without gradients (as a rotary table is) in,
    all three out; its Linear used twice, the second time on what the first made of the input (torch 2.11 and 2.12's
    split weight pass counts a gradient of it twice)."""

    def __init__(self, index: int) -> None:
        super().__init__()
        torch.manual_seed(index)
        self.embed, self.linear = nn.Embedding(16, DIM), nn.Linear(DIM, DIM)

    def forward(self, h: torch.Tensor, ids: torch.Tensor, table: torch.Tensor | None = None) -> tuple:
        if table is None:
            with torch.no_grad():
                table = torch.cos(ids.float())
        y = torch.tanh(self.linear(h) + self.embed(ids)) * table[:, None]
        return self.linear(y * h), ids, table


def _loss(output: tuple, target: torch.Tensor) -> torch.Tensor:
    return ((output[0] - target) ** 2).mean() / M


def _batch() -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    g = torch.Generator().manual_seed(0)
    return torch.randn(8, DIM, generator=g), torch.randint(0, 16, (8,), generator=g), torch.randn(8, DIM, generator=g)


def _rank(rank: int, port: int, out: str) -> None:
    import os

    import torch.distributed as dist
    from torch.distributed.pipelining import PipelineStage, ScheduleZBVZeroBubble

    from lightning_pp.runtime.inference_inputs import zeroed_inference_inputs
    from lightning_pp.runtime.split_backward import exact_split_backward

    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port))
    dist.init_process_group("gloo", rank=rank, world_size=2)
    torch.set_num_threads(1)
    indices = (rank, N_STAGES - 1 - rank)  # a V: rank 1 holds the two middle stages, handed over by hand
    pieces = {i: Piece(i) for i in indices}
    changed = {}
    stages = []
    for i in indices:
        # zeroed as the runtime does: torch >= 2.12 infers shapes on torch.empty, out of an embedding's range
        stage = zeroed_inference_inputs(PipelineStage(pieces[i], i, N_STAGES, torch.device("cpu")))
        before = dict(vars(stage))
        for name in COVERS:
            getattr(compat, name)(stage)
            now = vars(stage)
            changed[name] = changed.get(name, False) or any(now[k] is not before.get(k) for k in now)
            before = dict(vars(stage))
        stages.append(exact_split_backward(stage))  # as the runtime does, around the shims: whole where not exact
    schedule = ScheduleZBVZeroBubble(stages, M, loss_fn=_loss, scale_grads=False)
    h, ids, target = _batch()
    if rank == 0:
        schedule.step(h, ids, target=target)
    else:
        schedule.step()
    grads = {i: {n: p.grad.clone() for n, p in pieces[i].named_parameters()} for i in indices}
    dist.destroy_process_group()
    with open(f"{out}/{rank}.pkl", "wb") as f:
        pickle.dump((changed, grads), f)


@pytest.fixture(scope="module")
def zbv_job(tmp_path_factory):
    out = tmp_path_factory.mktemp("compat")
    mp.start_processes(_rank, args=(free_port(), str(out)), nprocs=2, start_method="fork")
    return [pickle.loads((out / f"{r}.pkl").read_bytes()) for r in (0, 1)]


def test_integer_tensors_between_stages_of_a_v_train_as_one_process(zbv_job):
    pieces = [Piece(i) for i in range(N_STAGES)]
    h, ids, target = _batch()
    for mb in range(M):  # one process, the same micro-batches
        out = (h.chunk(M)[mb], ids.chunk(M)[mb])
        for piece in pieces:
            out = piece(*out)
        _loss(out, target.chunk(M)[mb]).backward()
    for _, grads in zbv_job:
        for i, named in grads.items():
            for name, grad in named.items():
                assert torch.allclose(grad, dict(pieces[i].named_parameters())[name].grad, atol=1e-6), (i, name)


@pytest.mark.parametrize("shim", sorted(COVERS))
def test_each_shim_changes_a_stage_on_the_releases_it_covers_only(shim, zbv_job):
    oldest, newest = COVERS[shim]
    assert zbv_job[0][0][shim] == (oldest <= RELEASE <= newest), f"{shim} on torch {torch.__version__}"


def test_a_single_stage_schedule_is_set_up_with_the_arguments_its_release_takes():
    from torch.distributed.pipelining.schedules import PipelineScheduleSingle

    seen = []

    class Recording(PipelineScheduleSingle):
        def __init__(self) -> None:  # only the set-up is exercised
            pass

        def _initialize_stage(self, *args):
            seen.append(args)

        def _step_microbatches(self, *args, **kwargs):
            raise NotImplementedError

    compat.initialize_stage(Recording(), (), {"mb": 0}, torch.zeros(1))
    assert len(seen[0]) == (3 if RELEASE >= (2, 12) else 2)


def test_one_stager_serves_a_fit_s_background_saves_of_an_optimizer_state():
    # the optimizer's state is a defaultdict(dict): torch 2.11's stager, closed after its first save, could not copy
    # the dict class at the second ("KeyError: <class 'type'>")
    from torch.distributed.checkpoint.staging import DefaultStager, StagingOptions

    stager = compat.stager_kept_between_saves(DefaultStager(StagingOptions(False, False, False, False)))
    state = {"state": defaultdict(dict, {0: {"exp_avg": torch.zeros(3)}})}
    for value in (1.0, 2.0):
        state["state"][0]["exp_avg"].fill_(value)
        staged = stager.stage(state)
        assert staged["state"][0]["exp_avg"].tolist() == [value] * 3
    stager.close()
