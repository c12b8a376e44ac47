"""Helpers for tests that run real multi-process jobs (``tests/job.py``) and one-process references."""

from __future__ import annotations

import json
import os
import select
import signal
import socket
import subprocess
import sys
import tempfile
import time
from collections.abc import Callable, Sequence
from pathlib import Path
from typing import Any

import pytest
import torch

HERE = Path(__file__).parent
sys.path.insert(0, str(HERE))
# schedule="auto" keeps the machine's costs here, not in the home directory (every job and rank inherits it)
os.environ.setdefault("LIGHTNING_PP_CACHE", str(Path(os.environ.get("TMPDIR", "/tmp")) / f"lightning_pp_{os.getpid()}"))


def child_env() -> dict[str, str]:
    env = {
        k: v for k, v in os.environ.items() if not k.startswith(("PYTEST_", "LOCAL_RANK", "NODE_RANK", "WORLD_SIZE"))
    }
    for key in ("MASTER_ADDR", "MASTER_PORT", "RANK", "GROUP_RANK", "LOCAL_WORLD_SIZE", "OMP_NUM_THREADS"):
        env.pop(key, None)
    env["PYTHONUNBUFFERED"] = "1"
    return env


class Job:
    def __init__(self, proc: subprocess.CompletedProcess, out: Path, seconds: float) -> None:
        self.returncode = proc.returncode
        self.codes = [proc.returncode]  # each rank's exit status, where the ranks were forked
        self.output = proc.stdout
        self.out = out
        self.seconds = seconds

    def rank(self, r: int) -> dict[str, Any]:
        return json.loads((self.out / f"rank{r}.json").read_text())

    def state(self, name: str = "final.ckpt") -> dict[str, torch.Tensor]:
        return torch.load(self.out / name, weights_only=False, map_location="cpu")["state_dict"]


def run_job(
    cfg: dict[str, Any],
    out: Path,
    timeout: float = 180,
    command: list[str] | None = None,
    env: dict[str, str] | None = None,
    launcher: bool = False,
    restarts: int | None = None,
) -> Job:
    """Run tests/job.py as a real multi-process Lightning job.

    By default its ranks are forked from a process that has imported torch and Lightning once (see
    ``forked.py``: each rank runs the whole job, as under torchrun). ``launcher=True`` (or a ``command``)
    starts the job as a user would: one process, whose Lightning launcher starts the other ranks. ``restarts``
    runs the ranks under torchrun's elastic agent, which restarts them all that many times at most.
    """
    cfg = {**cfg, "out": str(out)}
    start = time.monotonic()
    if command is None and not launcher and cfg.get("strategy") != "single":
        request = {"cfg": cfg} if restarts is None else {"cfg": cfg, "restarts": restarts}
        codes, output = _FORKED.run(request, out.parent, env or {}, timeout)
        job = Job(subprocess.CompletedProcess([], max(codes, key=abs)), out, time.monotonic() - start)
        job.output, job.codes = output, codes
        return job
    command = command or [sys.executable, str(HERE / "job.py")]
    proc = subprocess.run(
        [*command, json.dumps(cfg)],
        cwd=out.parent,
        env={**child_env(), **(env or {})},
        capture_output=True,
        text=True,
        timeout=timeout,
    )
    job = Job(proc, out, time.monotonic() - start)
    job.output = proc.stdout + proc.stderr
    return job


class _Forked:
    """The fork server (``forked.py``), started at the first job and reused by every later one."""

    def __init__(self) -> None:
        self._proc: subprocess.Popen | None = None
        self._count = 0

    def run(self, job: dict[str, Any], cwd: Path, env: dict[str, str], timeout: float) -> tuple[list[int], str]:
        """``job``: ``{"cfg": ...}`` for tests/job.py's ranks, ``{"script": path}`` for ``python path``, or
        ``{"module": name, "argv": [...], "stderr": path}`` for ``python -m name ...`` (see ``forked.py``)."""
        if self._proc is None or self._proc.poll() is not None:
            self._proc = subprocess.Popen(
                [sys.executable, str(HERE / "forked.py")], env=child_env(), stdin=subprocess.PIPE,
                stdout=subprocess.PIPE, text=True, bufsize=1,
            )  # fmt: skip
        self._count += 1
        output = cwd / f".job{self._count}.log"
        request = dict(job, env=env, cwd=str(cwd), output=str(output), port=free_port())
        assert self._proc.stdin is not None and self._proc.stdout is not None
        self._proc.stdin.write(json.dumps(request) + "\n")
        leader = json.loads(self._proc.stdout.readline())["leader"]
        ready, _, _ = select.select([self._proc.stdout], [], [], timeout)
        if not ready:
            os.killpg(leader, signal.SIGKILL)
            self._proc.stdout.readline()
            raise subprocess.TimeoutExpired(str(job), timeout, output=output.read_text())
        codes = json.loads(self._proc.stdout.readline())["returncodes"]
        return codes, output.read_text()


_FORKED = _Forked()


def run_script(
    script: Path, timeout: float, ranks: int = 1, argv: Sequence[str] = (), cwd: Path | None = None
) -> tuple[int, str]:
    """``python script *argv`` in ``cwd`` (the script's directory), its first process forked from the fork server
    (see ``forked.py``), or with ``ranks`` > 1 as ``torchrun --nproc_per_node ranks script *argv`` would run it,
    every rank forked: the worst exit status and what it printed."""
    request = {"script": str(script), "ranks": ranks, "argv": list(argv)}
    codes, output = _FORKED.run(request, cwd or script.parent, {}, timeout)
    return max(codes, key=abs), output


def run_module(
    module: str, argv: list[str], cwd: Path, timeout: float, env: dict[str, str] | None = None, ranks: int = 1
) -> subprocess.CompletedProcess:
    """``python -m module *argv`` in ``cwd``, its first process forked from the fork server (see ``forked.py``),
    or with ``ranks`` > 1 as ``torchrun --nproc_per_node ranks -m module *argv`` would run it, every rank forked:
    the worst exit status, and what it printed to stdout and to stderr apart."""
    stderr = Path(tempfile.mkstemp(prefix=".stderr", dir=cwd)[1])
    request = {"module": module, "argv": argv, "stderr": str(stderr), "ranks": ranks}
    codes, stdout = _FORKED.run(request, cwd, env or {}, timeout)
    return subprocess.CompletedProcess([module, *argv], max(codes, key=abs), stdout, stderr.read_text())


def consolidate_cli(src: Path, dst: Path, *args: str) -> subprocess.CompletedProcess:
    """``python -m lightning_pp.consolidate SRC DST ARGS``, forked from the fork server (no second import of torch)."""
    return run_module("lightning_pp.consolidate", [str(src), str(dst), *args], Path(src).parent, timeout=180)


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def run_two_nodes(
    nproc_per_node: int,
    target: list[str],
    per_node: Callable[[int], list[str]] = lambda node: [],
    cwd: Path | None = None,
    timeout: float = 300,
) -> None:
    """Two torchrun "nodes" on loopback, started together; both must succeed."""
    port = free_port()
    procs = [
        subprocess.Popen(
            [sys.executable, "-m", "torch.distributed.run", "--nnodes", "2", "--node_rank", str(node),
             "--nproc_per_node", str(nproc_per_node), "--master_addr", "127.0.0.1", "--master_port", str(port),
             *target, *per_node(node)],
            cwd=cwd, env=child_env(), stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True,
        )
        for node in (0, 1)
    ]  # fmt: skip
    outputs = [p.communicate(timeout=timeout)[0] for p in procs]
    assert [p.returncode for p in procs] == [0, 0], outputs[0][-3000:] + outputs[1][-3000:]


def ok(job: Job) -> Job:
    assert job.returncode == 0, job.output[-4000:]
    return job


@pytest.fixture(scope="session")
def reference(tmp_path_factory):
    """One-process plain-Lightning runs of tests/job.py, cached by config."""
    import job as job_module

    cache: dict[str, dict[str, Any]] = {}

    def run(**cfg: Any) -> dict[str, Any]:
        key = json.dumps(cfg, sort_keys=True)
        if key not in cache:
            out = tmp_path_factory.mktemp("ref")
            result = job_module.run({**cfg, "strategy": "single", "threads": 1, "out": str(out)})
            # on the CPU as a pipeline's saved state is read back, whichever device one process trained on
            ckpt = torch.load(out / "final.ckpt", weights_only=False, map_location="cpu")
            result["state"], result["optimizer"] = ckpt["state_dict"], ckpt["optimizer_states"][0]
            result["out"] = out
            result["initial"] = torch.load(out / "initial.pt", map_location="cpu")
            cache[key] = result
        return cache[key]

    return run
