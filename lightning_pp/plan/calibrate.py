"""What the machine adds to a step whatever the model: message latency and bandwidth, the runtime's cost per
action and per step, and a rank's resident memory before any model.

Runs as its own job on two local ranks (``python -m torch.distributed.run --nproc_per_node 2 -m
lightning_pp.plan.calibrate OUT.json [ACCELERATOR]``, started by ``measure_machine``): one ping-pong at two
message sizes on the real backend, then two short fits of a model whose layers cost nothing through
``PipelineStrategy`` (1F1B at 2 to 16 micro-batches): what their steps take is the runtime's own cost,
split into a part per action and a part per step by the simulator.
"""

from __future__ import annotations

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
from lightning.fabric.utilities.distributed import _suggested_max_num_threads
from torch import nn

from lightning_pp.choose.machine import Machine, base_bytes, ping_pong, save_machine
from lightning_pp.memory.allocator import return_free_memory

_MICROBATCHES = (2, 4, 8, 16)
_STEPS = 20  # per fit; the first 4 are left out


def measure_machine(accelerator: str = "cpu", timeout_s: float = 300.0) -> Machine:
    """Launch the calibration job on two local ranks and read what it measured."""
    with tempfile.TemporaryDirectory() as tmp:
        out = Path(tmp) / "machine.json"
        env = {**os.environ, "OMP_NUM_THREADS": str(_suggested_max_num_threads(2))}
        command = [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc_per_node", "2"]
        run = subprocess.run(
            [*command, "-m", "lightning_pp.plan.calibrate", str(out), accelerator],
            env=env,
            capture_output=True,
            text=True,
            timeout=timeout_s,
        )
        if run.returncode != 0:
            raise RuntimeError(f"The calibration job failed (exit {run.returncode}):\n{run.stderr[-3000:]}")
        machine = Machine(**json.loads(out.read_text()))
    save_machine(machine, accelerator)  # schedule="auto" reads it: the runtime's costs need these short fits
    return machine


class _Free(nn.Module):
    """A layer that costs (nearly) nothing."""

    def __init__(self) -> None:
        super().__init__()
        self.scale = nn.Parameter(torch.ones(()))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return x * self.scale


def _fit_step_times(n_microbatches: int, accelerator: str) -> list[float]:
    import lightning as L

    from lightning_pp.strategy import PipelineStrategy

    class Tiny(L.LightningModule):
        def __init__(self) -> None:
            super().__init__()
            self.layers = nn.ModuleList(_Free() for _ in range(4))

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
        devices=2,
        strategy=PipelineStrategy(schedule="1f1b", n_microbatches=n_microbatches),
        max_steps=_STEPS,
        logger=False,
        enable_checkpointing=False,
        enable_progress_bar=False,
        enable_model_summary=False,
        callbacks=[Clock()],
    )
    data = torch.utils.data.DataLoader(torch.zeros(_STEPS * 16, 8), batch_size=16)
    trainer.fit(Tiny(), data)
    return [b - a for a, b in zip(ends[4:], ends[5:])]


def _split_overheads(step_s: dict[int, float], latency_s: float) -> tuple[float, float]:
    """The cost per action and per step that make the simulator's 1F1B fit the measured step times best (least
    squares: with actions of cost ``a`` the simulated step is ``a`` times the actions on its critical path plus
    the messages on it)."""
    from lightning_pp.choose.simulate import Costs, simulate

    def schedule_s(m: int, action: float) -> float:
        return simulate("1f1b", 2, m, Costs((action,) * 2, (action,) * 2, message=latency_s)).step_s

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


def _main(out: str, accelerator: str) -> None:
    rank = int(os.environ["RANK"])
    device = torch.device("cuda", int(os.environ["LOCAL_RANK"])) if accelerator == "gpu" else torch.device("cpu")
    dist.init_process_group("nccl" if device.type == "cuda" else "gloo")
    latency_s, bandwidth = ping_pong(0, 1, device)
    step_s = {m: statistics.median(_fit_step_times(m, accelerator)) for m in _MICROBATCHES}
    if dist.is_initialized():
        dist.destroy_process_group()
    action, step = _split_overheads(step_s, latency_s)
    # the fits' models are gone: what they leave in torch's cache or the heap is not the base
    return_free_memory(device)
    if rank == 0:
        machine = Machine(latency_s, bandwidth, action, step, base_bytes(device))
        Path(out).write_text(json.dumps(asdict(machine), indent=1))


if __name__ == "__main__":
    _main(sys.argv[1], sys.argv[2] if len(sys.argv) > 2 else "cpu")
