"""Starting the other ranks of a job: Lightning's launcher, with a child command that also works in
a Hydra multirun.

Lightning re-runs ``sys.argv`` for ranks > 0. Under ``-m`` that argv still holds the whole sweep, so
each child would start a sweep of its own; it also points the children at ``hydra.run.dir``, which
under multirun is not the job's directory. A child must run exactly the current job: its own
overrides, in its own output directory.
"""

from __future__ import annotations

import os
import subprocess
import sys
from collections.abc import Sequence

from lightning.fabric.strategies.launchers.subprocess_script import _basic_subprocess_cmd
from lightning.pytorch.strategies.launchers.subprocess_script import _SubprocessScriptLauncher
from typing_extensions import override

_CONFIG_FLAGS = ("--config-path", "-cp", "--config-name", "-cn", "--config-dir", "-cd")


def hydra_child_command(local_rank: int) -> tuple[list[str], str]:
    """The command that runs the current Hydra job (not the sweep) as rank ``local_rank``."""
    from hydra.core.hydra_config import HydraConfig
    from hydra.utils import get_original_cwd, to_absolute_path

    import __main__

    hydra = HydraConfig.get()
    if __main__.__spec__ is None:
        command = [sys.executable, to_absolute_path(sys.argv[0])]
    else:
        command = [sys.executable, "-m", __main__.__spec__.name]
    command += _config_flags(sys.argv[1:])
    command += list(hydra.overrides.task)
    command += [o for o in hydra.overrides.hydra if o.startswith("hydra.searchpath")]
    command += [
        f'hydra.run.dir="{hydra.runtime.output_dir}"',
        f"hydra.job.name={hydra.job.name}_rank{local_rank}",
        "hydra.output_subdir=null",
    ]
    return command, get_original_cwd()


def _config_flags(argv: Sequence[str]) -> list[str]:
    """``--config-path``/``--config-name``/``--config-dir`` and their values: not overrides, but needed."""
    kept: list[str] = []
    for i, arg in enumerate(argv):
        if arg in _CONFIG_FLAGS and i + 1 < len(argv):
            kept += [arg, argv[i + 1]]
        elif arg.startswith(tuple(f"{flag}=" for flag in _CONFIG_FLAGS)):
            kept.append(arg)
    return kept


def _hydra_in_use() -> bool:
    try:
        from hydra.core.hydra_config import HydraConfig
    except ImportError:
        return False
    return HydraConfig.initialized()


class PipelineLauncher(_SubprocessScriptLauncher):
    """Lightning's subprocess launcher, with Hydra children that run the current job only."""

    @override
    def _call_children_scripts(self) -> None:
        self._check_can_spawn_children()
        self.procs = []
        os.environ["MASTER_ADDR"] = self.cluster_environment.main_address
        os.environ["MASTER_PORT"] = str(self.cluster_environment.main_port)
        os.environ["NODE_RANK"] = str(self.cluster_environment.node_rank())
        os.environ["LOCAL_RANK"] = str(self.cluster_environment.local_rank())
        os.environ["WORLD_SIZE"] = f"{self.num_processes * self.num_nodes}"
        for local_rank in range(1, self.num_processes):
            env = {**os.environ, "LOCAL_RANK": str(local_rank)}
            if _hydra_in_use():
                command, cwd = hydra_child_command(local_rank)
            else:
                command, cwd = _basic_subprocess_cmd(), None
            self.procs.append(subprocess.Popen(command, env=env, cwd=cwd))
