"""Replica groups that survive a dead group (torchft): two pipeline jobs of 2 stages each (1F1B), each under
its own torchrun, meeting in a lighthouse this process runs.

One launch covers the whole story, checked against one process that trains, step by step, on the batches of
the groups that committed the step: both groups together; group 1's last-stage rank killed inside a step
(the survivor's step does not commit and leaves no trace); group 0 alone, never restarted; group 1 restarted
by torchrun, healed from group 0 (bit-identical from the step it joins), then both together to the end.
"""

from __future__ import annotations

import json
import subprocess
import sys
import time
from pathlib import Path

import pytest
import torch
from torch.utils.data import DistributedSampler
from conftest import HERE, child_env, free_port
from test_parity import PARAM_TOL

from lightning_pp import FaultTolerance, PipelineConfigError, PipelineStrategy

torchft = pytest.importorskip("torchft")

GROUPS, BATCH, N, STEPS, KILLED = 2, 4, 256, 30, 10
# each group's two ranks: two pipeline stages (DDP of one replica), or one stage FSDP-sharded over two replicas
LAYOUTS = {"2 stages": dict(pp=None, data_parallel="ddp", dp=1), "FSDP inside": dict(pp=1, data_parallel="fsdp", dp=2)}
TIMEOUT = 10  # seconds: the groups' average, commit and quorum; the lighthouse drops a silent group in 1 s


def start_group(cfg: dict, out: Path, restarts: int = 1) -> subprocess.Popen:
    return subprocess.Popen(
        [sys.executable, "-m", "torch.distributed.run", "--nproc_per_node", "2", "--master_addr", "127.0.0.1",
         "--master_port", str(free_port()), "--max_restarts", str(restarts), "--monitor_interval", "0.1",
         str(HERE / "ft_job.py"), json.dumps(cfg)],
        cwd=out, env={**child_env(), "OMP_NUM_THREADS": "1"}, stdout=(out / f"group{cfg['group']}.log").open("w"),
        stderr=subprocess.STDOUT,
    )  # fmt: skip


def run_groups(configs: list[dict], out: Path, min_groups: int = 1, restarts: int = 1) -> list[int]:
    """Each config a group under torchrun (with the lighthouse's address), meeting in a lighthouse this process
    serves (waiting for ``min_groups``); each group's exit status."""
    from torchft._torchft import LighthouseServer

    lighthouse = LighthouseServer(bind="[::]:0", min_replicas=min_groups, join_timeout_ms=1000, quorum_tick_ms=50,
                                  heartbeat_timeout_ms=1000)  # fmt: skip
    address = f"http://127.0.0.1:{lighthouse.address().rsplit(':', 1)[1]}"
    procs = [start_group({**cfg, "lighthouse": address}, out, restarts) for cfg in configs]
    try:
        return [p.wait(timeout=400) for p in procs]
    finally:
        for p in procs:
            p.kill()
        lighthouse.shutdown()


def lines(out: Path, group: int, rank: int) -> list[dict]:
    return [json.loads(line) for line in (out / f"group{group}_rank{rank}.jsonl").read_text().splitlines()]


@pytest.fixture(scope="module", params=list(LAYOUTS))
def killed_and_healed(request, tmp_path_factory):
    out = tmp_path_factory.mktemp("ft")
    layout = LAYOUTS[request.param]
    common = dict(groups=GROUPS, timeout=TIMEOUT, out=str(out), n=N, batch=BATCH, steps=STEPS, devices=2,
                  pp=layout["pp"], data_parallel=layout["data_parallel"])  # fmt: skip
    # group 0 meets the lighthouse first (so the two never train apart at the start: group 1 heals from it) and
    # paces its steps until group 1 has joined; after the kill it waits for group 1's restart and paces its steps
    # until the restarted group 1 has joined (torchft's lighthouse lets a group go on alone while another starts)
    survivor = dict(common, group=0, waits=[[KILLED + 4, "group1_attempt1_0"]],
                    pace=[[0, "group1_started0_0"], [KILLED + 3, "group1_started1_0"]])
    killed = dict(common, group=1, kill=[1, KILLED], setup_waits=["group0_started0_0"])
    codes = run_groups([survivor, killed], out)
    logs = "".join((out / f"group{g}.log").read_text()[-3000:] for g in range(GROUPS))
    assert codes == [0, 0], logs
    return out, layout["dp"]


def test_survivors_go_on_without_a_restart_and_leave_an_uncommitted_step_no_trace(killed_and_healed):
    out, _ = killed_and_healed
    for rank in (0, 1):
        survivor = lines(out, 0, rank)
        assert {line["attempt"] for line in survivor} == {0} and len({line["pid"] for line in survivor}) == 1
        before, failed, after = ({(line["epoch"], line["batch"]): line for line in survivor}[0, b]
                                 for b in (KILLED - 1, KILLED, KILLED + 1))  # fmt: skip
        # group 1 died inside this step: its average failed, nothing moved
        assert not failed["committed"] and failed["after"] == failed["step"], failed
        assert (failed["lr"], failed["crc"]) == (before["lr"], before["crc"])
        assert after["committed"] and after["participants"] == 1
        # the survivor stalled in the failed step for less than its timeout, never for a restart
        assert failed["time"] - before["time"] < TIMEOUT + 5
        assert survivor[-1]["after"] == STEPS and [line["committed"] for line in survivor].count(False) == 1


def test_the_restarted_group_heals_bit_identical_to_the_survivor(killed_and_healed):
    out, _ = killed_and_healed
    for rank in (0, 1):
        survivor = {(line["epoch"], line["batch"]): line for line in lines(out, 0, rank)}
        healed = [line for line in lines(out, 1, rank) if line["attempt"] == 1]
        assert healed[0]["step"] > KILLED
        for line in healed:  # from the step it joins: the same batch, weights, learning rate and counters
            twin = survivor[line["epoch"], line["batch"]]
            assert line["step"] == twin["step"]
            assert (line["crc"], line["lr"], line["after"], line["participants"]) == (
                twin["crc"], twin["lr"], twin["after"], 2)  # fmt: skip
        a, b = torch.load(out / f"group0_rank{rank}.pt"), torch.load(out / f"group1_rank{rank}.pt")
        assert a.keys() == b.keys() and all(torch.equal(a[k], b[k]) for k in a)


def test_the_groups_equal_one_process_on_the_committed_batches(killed_and_healed):
    import ft_job
    from models import Tokens

    out, dp = killed_and_healed
    data = Tokens(N, seed=0)
    # each replica reads its own share, as Lightning shards a loader (shuffled, seed 0): replica g x dp + r
    samplers = [DistributedSampler(data, GROUPS * dp, r, shuffle=True, seed=0) for r in range(GROUPS * dp)]

    def rows_of(replica: int, epoch: int, batch: int) -> list[int]:
        samplers[replica].set_epoch(epoch)
        return list(samplers[replica])[batch * BATCH : (batch + 1) * BATCH]

    together: dict[tuple[int, int], set[int]] = {}  # (step, quorum): the groups that committed it in that quorum
    for group in range(GROUPS):
        for line in lines(out, group, 1):
            if line["committed"]:
                together.setdefault((line["step"], line["quorum"]), set()).add(group)
                rows = rows_of(group * dp + dp - 1, line["epoch"], line["batch"])  # rank 1's replica's
                assert [int(data[r]["tokens"][0]) for r in rows] == line["tokens"]
    survivor = [line for line in lines(out, 0, 1) if line["committed"]]  # the lineage of the final weights
    assert [line["step"] for line in survivor] == list(range(STEPS))
    batches = []
    for line in survivor:
        groups = together[line["step"], line["quorum"]]
        assert len(groups) == line["participants"]
        rows = [row for g in sorted(groups) for r in range(dp)
                for row in rows_of(g * dp + r, line["epoch"], line["batch"])]  # fmt: skip
        batches.append({k: torch.stack([data[row][k] for row in rows]) for k in ("tokens", "targets")})
    assert len(batches) == STEPS
    one = ft_job.reference(batches)
    pipeline = {k: v for r in (0, 1) for k, v in torch.load(out / f"group0_rank{r}.pt").items()}
    assert pipeline.keys() == one.keys()
    for key, value in one.items():
        assert torch.allclose(pipeline[key], value, atol=PARAM_TOL, rtol=0), (key, (pipeline[key] - value).abs().max())


def test_groups_that_start_from_different_weights_are_refused(tmp_path):
    # the lighthouse waits for both: they meet at step 0, so neither heals from the other; group 1 seeded apart
    common = dict(groups=2, timeout=TIMEOUT, out=str(tmp_path), n=N, batch=BATCH, steps=2, devices=2)
    codes = run_groups([dict(common, group=g, seed=g) for g in range(2)], tmp_path, min_groups=2, restarts=0)
    for group, code in enumerate(codes):
        log = (tmp_path / f"group{group}.log").read_text()
        assert code != 0 and f"Replica group {group} holds other weights than the live groups" in log, log[-3000:]


def test_a_group_that_never_commits_stops_with_the_reason(tmp_path):
    cfg = dict(groups=2, group=0, timeout=TIMEOUT, out=str(tmp_path), n=N, batch=BATCH, steps=STEPS, devices=2,
               min_groups=2)  # fmt: skip
    (code,) = run_groups([cfg], tmp_path, restarts=0)
    log = (tmp_path / "group0.log").read_text()
    assert code != 0 and "11 steps in a row did not commit" in log and "min_groups=2" in log, log[-3000:]
    assert all(not line["committed"] and line["after"] == 0 for line in lines(tmp_path, 0, 1))


def test_a_lighthouse_that_is_not_there_is_refused_on_every_rank_in_seconds(tmp_path):
    cfg = dict(groups=2, group=0, lighthouse=f"http://127.0.0.1:{free_port()}", timeout=TIMEOUT, connect_timeout=2,
               out=str(tmp_path), n=N, batch=BATCH, steps=2, devices=2)  # fmt: skip
    start = time.monotonic()
    code = start_group(cfg, tmp_path, restarts=0).wait(timeout=120)
    log = (tmp_path / "group0.log").read_text()
    assert code != 0 and log.count(f"The torchft lighthouse at {cfg['lighthouse']} did not answer within 2 s") >= 2
    assert time.monotonic() - start < 90, log[-2000:]


@pytest.mark.parametrize(
    "arguments, named",
    [
        (dict(schedule="2bw"), "schedule='2bw' with fault_tolerance"),
        (dict(schedule="auto"), "given as 'auto' with fault_tolerance"),
        (dict(microbatch_weight=len), "microbatch_weight with fault_tolerance"),
    ],
)
def test_what_cannot_be_exact_across_groups_is_refused(arguments, named):
    with pytest.raises(PipelineConfigError, match=named):
        PipelineStrategy(fault_tolerance={"group": 0, "groups": 2}, **arguments)
    with pytest.raises(PipelineConfigError, match="group=2 with groups=2"):
        FaultTolerance(group=2, groups=2)
