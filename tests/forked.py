"""Starts the ranks of test jobs by forking one process that has already imported torch and Lightning.

Each rank of a real job spends about 7 s of CPU importing torch, Lightning and torchmetrics before
it does anything, most of a small test job's cost on 2 cores. This server imports them once; for
each job it forks a leader in a new session, which forks the ranks with the environment torchrun
gives them (Lightning then starts no processes of its own, as under torchrun) and waits for all of
them. Every rank runs ``job.run(cfg)`` whole, as a rank started by a launcher would, and fails as one
would. Tests of the launch itself (a job started as a user starts it, a rank that dies under Lightning's
launcher, each rank's own memory) use Lightning's launcher instead (``run_job(..., launcher=True)``).

A request with ``restarts`` runs the ranks under torch's elastic agent, as ``torchrun --standalone
--max-restarts=N`` does (the same agent, rendezvous and restart count), but started by fork: each restart
then costs no imports.

A request with a ``script`` (the docs' blocks, a benchmark) or a ``module`` (the apps), each with its ``argv``, in
place of a ``cfg`` runs as ``python SCRIPT ARGV`` or ``python -m MODULE ARGV`` would, in one forked process: only
the first process's imports are saved. With ``ranks`` N, a script runs as ``torchrun --nproc_per_node N SCRIPT``
would: N forked processes with torchrun's environment, so Lightning starts none of its own.

Protocol, one JSON line each way per job on stdin/stdout: ``{"cfg" or "script" or "module", "argv",
"env", "cwd", "output", optionally "stderr", "restarts" or "ranks", "port"}`` in; ``{"leader": pid}`` when started, then
``{"returncodes": [...]}`` when every rank has exited.
"""

from __future__ import annotations

import json
import os
import runpy
import sys
import traceback
from collections.abc import Callable

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))

import job  # noqa: E402  (torch, Lightning and lightning_pp, imported once)
import torch.fx  # noqa: E402

# A traced model's pieces (split="trace") keep no source line per operation: recording them is a fifth of each
# trace's time here (most of a small traced job's), and they only annotate torch's own errors from inside a piece
torch.fx.config.do_not_emit_stack_traces = True


def _torchrun_env(request: dict, rank: int, world: int, nodes: int = 1) -> None:
    """What torchrun gives ``rank`` of ``world``, its ranks in ``nodes`` consecutive groups (one per node)."""
    local = world // nodes
    os.environ.update(request["env"])
    os.environ.update(
        MASTER_ADDR="127.0.0.1", MASTER_PORT=str(request["port"]), WORLD_SIZE=str(world), RANK=str(rank),
        LOCAL_RANK=str(rank % local), LOCAL_WORLD_SIZE=str(local), GROUP_RANK=str(rank // local),
        NODE_RANK=str(rank // local), TORCHELASTIC_RUN_ID="forked",
    )  # fmt: skip


def _exit_after(run: Callable[[], object]) -> None:
    """Ends the process with ``run``'s outcome as its exit status (1 with the traceback printed), as a rank would."""
    code = 0
    try:
        run()
    except SystemExit as stop:  # as Python ends a process: its code, 1 for a message
        code = stop.code if isinstance(stop.code, int) else 0 if stop.code is None else 1
    except BaseException:  # noqa: B036  (the rank's exit status is what the test reads)
        traceback.print_exc()
        code = 1
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(code)


def _script(request: dict) -> None:
    """``python SCRIPT`` (or ``python -m MODULE ARGV``) with its imports done: Lightning's launcher starts the
    other ranks, fresh, by re-running the command (unless torchrun's environment is set), and the process ends
    as Python ends one (atexit, logging), with the status Python would give."""
    os.environ.update(request["env"])
    sys.argv = ["", *request.get("argv", [])]  # argv[0]: set by runpy, as by Python
    try:
        if "module" in request:
            runpy.run_module(request["module"], run_name="__main__", alter_sys=True)
        else:
            sys.path.insert(0, os.path.dirname(os.path.abspath(request["script"])))  # as Python puts it first
            runpy.run_path(request["script"], run_name="__main__")
    except SystemExit:
        raise
    except BaseException:  # noqa: B036
        traceback.print_exc()
        sys.exit(1)
    sys.exit(0)


def _elastic(request: dict, world: int) -> None:
    """The ranks under torchrun's agent, which restarts them all (forked again) up to ``restarts`` times."""
    from torch.distributed.launcher.api import LaunchConfig, elastic_launch

    os.environ.update(request["env"])
    config = LaunchConfig(min_nodes=1, max_nodes=1, nproc_per_node=world, run_id=f"forked{request['port']}",
                          rdzv_backend="c10d", rdzv_endpoint="localhost:0", max_restarts=request["restarts"],
                          start_method="fork")  # fmt: skip
    elastic_launch(config, job.run)(request["cfg"])


def _child(request: dict, rank: int, world: int, nodes: int) -> None:
    """One forked process of the job: torchrun's agent, a rank of ``job.run``, or the script's (first) process."""
    if "restarts" in request:
        _exit_after(lambda: _elastic(request, world))
    if "cfg" in request or world > 1:  # ranks started together, as torchrun starts them
        _torchrun_env(request, rank, world, nodes)
    if "cfg" in request:
        _exit_after(lambda: job.run(request["cfg"]))
    _script(request)


def _lead(request: dict) -> None:
    os.setsid()  # the test kills the whole job on a timeout
    os.chdir(request["cwd"])
    out = os.open(request["output"], os.O_WRONLY | os.O_CREAT | os.O_APPEND)
    os.dup2(out, 1)
    os.dup2(os.open(request["stderr"], os.O_WRONLY | os.O_CREAT | os.O_APPEND) if "stderr" in request else out, 2)
    cfg = request.get("cfg", {})
    nodes = int(cfg.get("num_nodes", 1))
    world = int(cfg["devices"]) * nodes if cfg else request.get("ranks", 1)
    pids = []
    for rank in range(1 if "restarts" in request else world):
        pid = os.fork()
        if pid == 0:
            _child(request, rank, world, nodes)
        pids.append(pid)
    codes = [os.waitstatus_to_exitcode(os.waitpid(pid, 0)[1]) for pid in pids]
    with open(request["output"] + ".codes", "w") as f:
        json.dump(codes, f)
    os._exit(0)


def serve() -> None:
    for line in sys.stdin:
        request = json.loads(line)
        leader = os.fork()
        if leader == 0:
            _lead(request)
        print(json.dumps({"leader": leader}), flush=True)
        os.waitpid(leader, 0)
        try:
            with open(request["output"] + ".codes") as f:
                codes = json.load(f)
        except FileNotFoundError:  # killed on a timeout
            codes = [-9]
        print(json.dumps({"returncodes": codes}), flush=True)


if __name__ == "__main__":
    serve()
