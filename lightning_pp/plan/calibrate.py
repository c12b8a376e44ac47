"""What the machine adds to a step whatever the model (message latency and bandwidth, the runtime's cost per
action and per step, a rank's resident memory before any model), and the planner's short runs of the app: one
launch of the ranks for all of them.

``launch`` starts ``python -m torch.distributed.run --standalone --nproc_per_node R -m lightning_pp.plan.calibrate
SPEC.json`` (``measure_machine``: the machine first, by default alone on two ranks). Each rank imports torch and
Lightning once (about 10 s on a CPU) for the machine and every run, where a launch per run paid it per run. The
machine: one ping-pong at two message sizes on the real backend, then short fits of a model whose layers cost
nothing through ``PipelineStrategy`` (1F1B at 1 to 8 micro-batches per rank): what their steps take is the runtime's
own cost, split into a part per action and a part per step by the simulator. A run: the app's config composed from
its overrides as ``python -m lightning_pp.train`` composes it, trained by the app's own ``run`` into the run's
directory (its ``result.json``); each run's process group meets in a store of its own (``lifecycle.rendezvous``).
"""

from __future__ import annotations

import gc
import json
import os
import statistics
import subprocess
import sys
import tempfile
import time
from collections.abc import Sequence
from dataclasses import asdict
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist
from hydra import compose, initialize_config_module
from hydra.core.hydra_config import HydraConfig
from lightning.fabric.utilities.distributed import _suggested_max_num_threads
from omegaconf import open_dict
from torch import nn

from lightning_pp.choose.machine import Machine, base_bytes, ping_pong, save_machine
from lightning_pp.memory.allocator import return_free_memory
from lightning_pp.train.app import job_scope, run

_MICROBATCHES = (1, 2, 4, 8)  # per rank
_STEPS = 20  # per fit; the first 4 are left out


def measure_machine(
    accelerator: str = "cpu",
    ranks: int = 2,
    runs: Sequence[tuple[Sequence[str], Path]] = (),
    timeout_s: float | None = 300.0,
) -> Machine:
    """The machine measured on ``ranks`` local processes (kept where schedule="auto" reads it), which then train
    each of ``runs`` (the app's overrides, the run's directory) in the same launch."""
    with tempfile.TemporaryDirectory() as tmp:
        out = Path(tmp) / "machine.json"
        launch(runs, ranks, timeout_s, measure={"accelerator": accelerator, "out": str(out)})
        machine = Machine(**json.loads(out.read_text()))
    save_machine(machine, accelerator)  # schedule="auto" reads it: the runtime's costs need these short fits
    return machine


def launch(
    runs: Sequence[tuple[Sequence[str], Path]],
    ranks: int,
    timeout_s: float | None = None,
    measure: dict[str, str] | None = None,
) -> None:
    """``ranks`` local processes that train each run in turn (after measuring the machine, given ``measure``)."""
    with tempfile.TemporaryDirectory() as tmp:
        spec = Path(tmp) / "spec.json"
        spec.write_text(json.dumps({"measure": measure, "runs": [[list(o), str(d)] for o, d in runs]}))
        env = {**os.environ, "OMP_NUM_THREADS": str(_suggested_max_num_threads(ranks))}
        command = [sys.executable, "-m", "torch.distributed.run", "--standalone", f"--nproc_per_node={ranks}"]
        done = subprocess.run(
            [*command, "-m", "lightning_pp.plan.calibrate", str(spec)],
            env=env,
            capture_output=True,
            text=True,
            timeout=timeout_s,
        )
    if done.returncode != 0:
        jobs = "; ".join(" ".join(o) for o, _ in runs) or "none"
        machine = measure["accelerator"] if measure else "not measured"
        raise RuntimeError(
            f"The planner's launch (machine: {machine}; runs: {jobs}) failed (exit {done.returncode}):\n"
            f"{done.stderr[-3000:]}"
        )


class _Free(nn.Module):
    """A layer that costs (nearly) nothing."""

    def __init__(self) -> None:
        super().__init__()
        self.scale = nn.Parameter(torch.ones(()))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return x * self.scale


def _fit_step_times(n_microbatches: int, accelerator: str, ranks: int) -> list[float]:
    import lightning as L

    from lightning_pp.strategy import PipelineStrategy

    class Tiny(L.LightningModule):
        def __init__(self) -> None:
            super().__init__()
            self.layers = nn.ModuleList(_Free() for _ in range(max(4, ranks)))

        def forward(self, x: torch.Tensor) -> torch.Tensor:
            for layer in self.layers:
                x = layer(x)
            return x

        def training_step(self, batch: torch.Tensor, batch_idx: int) -> torch.Tensor:
            loss = self(batch).square().mean()
            self.log("train_loss", loss)
            return loss

        def configure_optimizers(self) -> Any:
            return torch.optim.SGD(self.parameters(), lr=0.0)

    ends: list[float] = []

    class Clock(L.Callback):
        def on_train_batch_end(self, *_: Any) -> None:
            ends.append(time.perf_counter())

    trainer = L.Trainer(
        accelerator=accelerator,
        devices=ranks,
        strategy=PipelineStrategy(schedule="1f1b", n_microbatches=n_microbatches),
        max_steps=_STEPS,
        logger=False,
        enable_checkpointing=False,
        enable_progress_bar=False,
        enable_model_summary=False,
        callbacks=[Clock()],
    )
    batch = ranks * _MICROBATCHES[-1]
    data = torch.utils.data.DataLoader(torch.zeros(_STEPS * batch, 8), batch_size=batch)
    trainer.fit(Tiny(), data)
    return [b - a for a, b in zip(ends[4:], ends[5:])]


def _split_overheads(step_s: dict[int, float], latency_s: float, ranks: int) -> tuple[float, float]:
    """The cost per action and per step that make the simulator's 1F1B fit the measured step times best (least
    squares: with actions of cost ``a`` the simulated step is ``a`` times the actions on its critical path plus
    the messages on it)."""
    from lightning_pp.choose.simulate import Costs, simulate

    def schedule_s(m: int, action: float) -> float:
        return simulate("1f1b", ranks, m, Costs((action,) * ranks, (action,) * ranks, message=latency_s)).step_s

    ms = sorted(step_s)
    rows = [[schedule_s(m, 1.0) - schedule_s(m, 0.0), 1.0] for m in ms]  # actions on the critical path; one step
    per_action, per_step = fit_nonnegative(rows, [step_s[m] - schedule_s(m, 0.0) for m in ms])
    return per_action, per_step


def fit_nonnegative(rows: Sequence[Sequence[float]], values: Sequence[float]) -> list[float]:
    """Least-squares coefficients, none negative (a negative one is fixed at 0 and the rest fitted again): the
    costs per action, per message, per step that best explain ``values`` from how many of each ``rows`` has."""
    free = list(range(len(rows[0])))
    while True:
        a = torch.tensor([[row[j] for j in free] for row in rows], dtype=torch.float64)
        b = torch.tensor(list(values), dtype=torch.float64).unsqueeze(1)
        solution = torch.linalg.lstsq(a, b, driver="gelsd").solution.squeeze(1).tolist()
        if min(solution, default=0.0) >= 0 or len(free) == 1:
            out = [0.0] * len(rows[0])
            for j, x in zip(free, solution):
                out[j] = max(x, 0.0)
            return out
        free.pop(solution.index(min(solution)))


def _measure(out: Path, accelerator: str) -> None:
    rank, ranks = int(os.environ["RANK"]), int(os.environ["WORLD_SIZE"])
    device = torch.device("cuda", int(os.environ["LOCAL_RANK"])) if accelerator == "gpu" else torch.device("cpu")
    dist.init_process_group("nccl" if device.type == "cuda" else "gloo")
    latency_s, bandwidth = ping_pong(0, 1, device)
    step_s = {m * ranks: statistics.median(_fit_step_times(m * ranks, accelerator, ranks)) for m in _MICROBATCHES}
    if dist.is_initialized():
        dist.destroy_process_group()
    action, step = _split_overheads(step_s, latency_s, ranks)
    # the fits' models are gone: what they leave (cyclic garbage, torch's cache, the heap) is not the base
    gc.collect()
    return_free_memory(device)
    if rank == 0:
        machine = Machine(latency_s, bandwidth, action, step, base_bytes(device))
        out.write_text(json.dumps(asdict(machine), indent=1))


def _train(overrides: Sequence[str], job: Path) -> None:
    """One run of the app, its config composed as ``python -m lightning_pp.train`` composes it."""
    with initialize_config_module("lightning_pp.conf", version_base="1.3"):
        cfg = compose("config", overrides=list(overrides), return_hydra_config=True)
    job.mkdir(parents=True, exist_ok=True)
    with open_dict(cfg):
        cfg.hydra.runtime.output_dir = str(job)
    HydraConfig.instance().set_config(cfg)
    with open_dict(cfg):
        del cfg["hydra"]
    with job_scope():
        run(cfg)


def _main(spec: dict[str, Any]) -> None:
    if spec["measure"]:
        _measure(Path(spec["measure"]["out"]), spec["measure"]["accelerator"])
    for overrides, job in spec["runs"]:
        _train(overrides, Path(job))


if __name__ == "__main__":
    _main(json.loads(Path(sys.argv[1]).read_text()))
