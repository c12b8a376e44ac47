"""A restarted attempt meets in a store of its own, so nothing of a dead attempt can reach it.

torchrun's agent hosts one TCP store for the whole job and hands it to every attempt
(``TORCHELASTIC_USE_AGENT_STORE``; static and c10d rendezvous alike in torch 2.13), without a
per-attempt prefix. What a killed attempt wrote there stays: gloo's addresses of the dead ranks under
``default_pg/0/``, our failure keys, barrier counters. A restarted rank that reads a peer's address
before the peer has rewritten it connects to a port nobody listens on any more, and
``init_process_group`` hangs until its timeout (1 restart in 3 here; plain DDP fails the same way with
"Connection refused"). ``TORCHELASTIC_RESTART_COUNT`` cannot name the attempt: each agent counts only
its own node's failures (pytorch/pytorch#108158, #135712).

So rank 0 of every attempt hosts a fresh store on a free port and leaves its port and a random token
in the launcher's store; the other ranks take the port only from a store that holds that token (a
port of a dead attempt refuses the connection, one that another process reuses lacks the token). Then
every rank checks in, and a rank that has not arrived within the timeout is named on every rank that
did, before any collective. A process that runs several jobs in turn (the planner's runs, one launch)
counts its process groups: each leaves its port under a key of its own, so a rank never finds the one
its peers closed a job ago.
"""

from __future__ import annotations

import itertools
import os
import time
import uuid
from datetime import timedelta

import torch
import torch.distributed as dist
from lightning.fabric.plugins.environments import ClusterEnvironment
from lightning.fabric.utilities.distributed import _init_dist_connection
from torch.distributed.distributed_c10d import _get_default_store

from lightning_pp.lifecycle.exit import close_process_groups_at_exit
from lightning_pp.lifecycle.heartbeat import start_heartbeat

_WHERE = "lightning_pp/attempt_store"  # in the launcher's store, per process group: "PORT TOKEN" of the newest attempt
_TOKEN = "lightning_pp/token"
_ARRIVED = "lightning_pp/arrived"
_PROBE = timedelta(seconds=2)  # connecting to a port of a dead attempt: refused at once, retried this long
_groups = itertools.count()  # this process's process groups, in the order every rank of the launch makes them


def connect(environment: ClusterEnvironment, backend: str, timeout: timedelta, device: torch.device) -> None:
    """The default process group (once per process), closed at exit, and this rank's heartbeat."""
    device_id = device if device.type != "cpu" else None
    _init_dist_connection(environment, backend, timeout=timeout, device_id=device_id, **_attempt_store(timeout))
    close_process_groups_at_exit()
    if dist.get_world_size() > 1:
        start_heartbeat(_get_default_store(), dist.get_rank(), timeout)


def _attempt_store(timeout: timedelta) -> dict[str, dist.Store]:
    """``init_process_group``'s ``store=`` under torchrun's agent store (none elsewhere: Lightning's rank 0
    then hosts a fresh store for each launch itself)."""
    if os.environ.get("TORCHELASTIC_USE_AGENT_STORE") != str(True) or dist.is_initialized():
        return {}
    rank, world = int(os.environ["RANK"]), int(os.environ["WORLD_SIZE"])
    host, port = os.environ["MASTER_ADDR"], int(os.environ["MASTER_PORT"])
    launcher = dist.TCPStore(host, port, world, is_master=False, timeout=timeout)
    where = f"{_WHERE}/{next(_groups)}"
    if rank == 0:
        store = dist.TCPStore(host, 0, world, is_master=True, timeout=timeout, wait_for_workers=False)
        token = uuid.uuid4().hex
        store.set(_TOKEN, token)
        launcher.set(where, f"{store.port} {token}")
    else:
        store = _join(launcher, where, host, timeout)
    _check_in(store, rank, world, timeout)
    return {"store": store}


def _join(launcher: dist.Store, where: str, host: str, timeout: timedelta) -> dist.Store:
    deadline = time.monotonic() + timeout.total_seconds()
    while time.monotonic() < deadline:
        if launcher.check([where]):
            port, token = launcher.get(where).decode().split()
            try:
                store = dist.TCPStore(host, int(port), is_master=False, timeout=_PROBE)
                if store.check([_TOKEN]) and store.get(_TOKEN).decode() == token:
                    store.set_timeout(timeout)
                    return store
            except (RuntimeError, dist.DistError):  # the port of a dead attempt
                pass
        time.sleep(0.1)
    raise TimeoutError(
        f"Rank 0 of this attempt did not open its store at {host} within the process-group timeout"
        f" ({timeout}): is rank 0 running? PipelineStrategy(timeout=...) sets how long ranks wait."
    )


def _check_in(store: dist.Store, rank: int, world: int, timeout: timedelta) -> None:
    """Every rank of the attempt arrives, or the ones that did name the ones that did not."""
    store.set(f"{_ARRIVED}/{rank}", "1")
    arrivals = [f"{_ARRIVED}/{r}" for r in range(world)]
    try:
        store.wait(arrivals, timeout)
    except (RuntimeError, dist.DistError):
        missing = [r for r, key in enumerate(arrivals) if not store.check([key])]
        raise TimeoutError(
            f"Ranks {missing} of {world} did not start within the process-group timeout ({timeout}); rank"
            f" {rank} stops. Look at those ranks' logs; PipelineStrategy(timeout=...) sets how long ranks wait."
        ) from None


def store_address() -> tuple[str, int]:
    """Where this attempt's ranks met (its own store under torchrun): torchft's manager meets its group there,
    never in a store a dead attempt left keys in."""
    store = _get_default_store()
    while isinstance(store, dist.PrefixStore):
        store = store.underlying_store
    if isinstance(store, dist.TCPStore):
        return store.host, store.port
    return os.environ["MASTER_ADDR"], int(os.environ["MASTER_PORT"])
