"""The app's ``ft`` group: replica groups that survive a dead group (torchft), on one machine or as given.

``ft=local`` makes this process the supervisor: it serves a torchft lighthouse and starts ``ft.groups``
replica groups, each ``torchrun --max_restarts ft.restarts`` of the app with the same overrides plus
``ft=group`` and its id, in a directory of its own under this run's. ``ft=group`` (one group of a SLURM job,
or a torchrun of one's own) hands the keys to ``strategy.fault_tolerance``.
"""

from __future__ import annotations

import socket
import subprocess
import sys
from pathlib import Path
from typing import Any, Optional

from omegaconf import DictConfig, OmegaConf

from lightning_pp.errors import PipelineConfigError

_GROUP_KEYS = ("group", "groups", "lighthouse", "min_groups", "timeout")


def fault_tolerance(cfg: DictConfig) -> Optional[dict[str, Any]]:
    """``strategy.fault_tolerance`` for a job that is one replica group (``ft=group``), else what it says."""
    ft = cfg.get("ft")
    if ft is None or ft.get("mode") != "group":
        return None
    return {key: ft[key] for key in _GROUP_KEYS}


def run_local_groups(cfg: DictConfig, out: Path, overrides: list[str]) -> int:
    """Serve the lighthouse, run every group to its end under torchrun; the worst exit status."""
    from torchft._torchft import LighthouseServer

    ft = cfg.ft
    devices = cfg.trainer.get("devices")
    if not isinstance(devices, int):
        raise PipelineConfigError(
            f"ft=local with trainer.devices={devices!r}: give the number of ranks each replica group runs (an integer)."
        )
    lighthouse = LighthouseServer(
        bind="[::]:0", min_replicas=int(ft.min_groups), join_timeout_ms=int(ft.join_timeout_ms),
        heartbeat_timeout_ms=int(ft.heartbeat_timeout_ms),
    )  # fmt: skip
    address = f"http://{socket.gethostname()}:{lighthouse.address().rsplit(':', 1)[1]}"
    own = [o for o in overrides if not o.lstrip("+~").startswith(("ft=", "ft.", "hydra.run.dir"))]
    procs = []
    try:
        for group in range(int(ft.groups)):
            keys = {"group": group, "groups": ft.groups, "lighthouse": address, "min_groups": ft.min_groups,
                    "timeout": ft.timeout}  # fmt: skip
            command = [
                sys.executable, "-m", "torch.distributed.run", "--nproc_per_node", str(devices),
                "--max_restarts", str(ft.restarts), "--master_addr", "127.0.0.1", "--master_port", str(_free_port()),
                "-m", "lightning_pp.train", *own, "ft=group", *(f"ft.{k}={v}" for k, v in keys.items()),
                f"hydra.run.dir={out / f'group{group}'}",
            ]  # fmt: skip
            (out / f"group{group}").mkdir(parents=True, exist_ok=True)
            log = (out / f"group{group}" / "torchrun.log").open("w")
            procs.append(subprocess.Popen(command, stdout=log, stderr=subprocess.STDOUT))
        codes = [p.wait() for p in procs]
    finally:
        for p in procs:
            p.kill()
        lighthouse.shutdown()
    summary = {f"group{g}": code for g, code in enumerate(codes)}
    (out / "groups.yaml").write_text(OmegaConf.to_yaml({"lighthouse": address, "exit_status": summary}))
    return max(codes, key=abs)


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]
