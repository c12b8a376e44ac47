"""Shared pieces of the benchmarks: the model and data of the design card, machine info, medians."""

from __future__ import annotations

import json
import os
import platform
import resource
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

import torch

# the model of the design card: 8 TransformerEncoderLayers, d=256, 4 heads, ff 1024, vocab 1000, 64 tokens
MODEL = dict(vocab=1000, dim=256, n_layers=8, n_heads=4, seq_len=64)
BATCH = 32
# a model larger than a process should hold whole (large_model.py): 12 blocks of 1024, 151 M parameters
LARGE = dict(vocab=64, dim=1024, n_layers=12, n_heads=16, seq_len=8, steps=2)
# steps left out before timing: the first also runs torch's shape inference
WARMUP = 3
HERE = Path(__file__).parent
# where the strategy benchmarks run and write (scripts/gpu_check.sh: cuda, and a folder of their own)
ACCELERATOR = os.environ.get("BENCH_ACCELERATOR", "cpu")
RESULTS = Path(os.environ.get("BENCH_RESULTS", HERE / "results"))


def launch(script: str, *args: Any, extra: str | None = None, ranks: int | None = 2) -> dict[str, Any]:
    """Run ``script ARGS OUT [EXTRA]`` with one thread per process and return the JSON it wrote to OUT:
    under torchrun on ``ranks`` local processes (as the tutorial launches), or as one plain process."""
    with tempfile.TemporaryDirectory() as tmp:
        out = Path(tmp) / "result.json"
        # benchmarks/ first, then the caller's path (a checkout of lightning_pp put there runs, not an installed one)
        path = os.pathsep.join([str(HERE), *filter(None, [os.environ.get("PYTHONPATH")])])
        env = {**os.environ, "OMP_NUM_THREADS": "1", "PYTHONPATH": path}
        launcher = (
            [] if ranks is None else ["-m", "torch.distributed.run", "--standalone", "--nproc_per_node", str(ranks)]
        )
        command = [sys.executable, *launcher, str(HERE / script), *map(str, args), str(out)]
        subprocess.run(
            command + ([extra] if extra else []),
            check=True,
            env=env,
            stdout=subprocess.DEVNULL,
            stderr=subprocess.DEVNULL,
        )
        return json.loads(out.read_text())


def proc_kib(key: str) -> int:
    """A ``/proc/self/status`` field in KiB (``VmRSS:``, ``VmHWM:``)."""
    return int(next(line for line in open("/proc/self/status") if line.startswith(key)).split()[1])


def usage() -> tuple[int, float, float, float]:
    """This process's minor page faults and system CPU seconds so far (``getrusage``), its seconds inside torch's
    pipeline schedules' ``step`` so far (``time_schedules``), and the time now."""
    now = resource.getrusage(resource.RUSAGE_SELF)
    return now.ru_minflt, now.ru_stime, _INSIDE[0], time.perf_counter()


_INSIDE = [0.0]


def time_schedules() -> None:
    """From now on, count the seconds this process spends inside every torch pipeline schedule's ``step``: a step's
    time outside it is the strategy's (or the raw script's) own, on that rank."""
    from torch.distributed.pipelining import schedules

    for cls in (schedules.PipelineScheduleSingle, schedules.PipelineScheduleMulti):
        original = cls.step

        def timed(self: Any, *args: Any, _original: Any = original, **kwargs: Any) -> Any:
            start = time.perf_counter()
            try:
                return _original(self, *args, **kwargs)
            finally:
                _INSIDE[0] += time.perf_counter() - start

        cls.step = timed  # type: ignore[method-assign]


def outside_schedule(marks: list) -> float:
    """A rank's median seconds per step outside the schedule's ``step``, from its ``usage()`` at each step's end."""
    steps = zip(marks[WARMUP:], marks[WARMUP + 1 :])
    return statistics.median((b[3] - a[3]) - (b[2] - a[2]) for a, b in steps)


def step_times(ends: list[float]) -> list[float]:
    """Wall time between consecutive step ends after the warm-up."""
    return [b - a for a, b in zip(ends[WARMUP:], ends[WARMUP + 1 :])]


def batches(n: int, seed: int = 0, vocab: int = MODEL["vocab"]) -> list[tuple[torch.Tensor, torch.Tensor]]:
    g = torch.Generator().manual_seed(seed)
    data = torch.randint(0, vocab, (n, BATCH, MODEL["seq_len"] + 1), generator=g)
    return [(d[:, :-1], d[:, 1:]) for d in data]


def pipeline_trainer(schedule: str, m: int, steps: int, callbacks: list[Any], **strategy: Any) -> Any:
    """The Trainer every strategy benchmark uses: torchrun's ranks, nothing but training and ``callbacks``;
    ``strategy`` holds further PipelineStrategy arguments."""
    import lightning as L

    from lightning_pp import PipelineStrategy

    return L.Trainer(
        accelerator=ACCELERATOR,
        devices=int(os.environ.get("LOCAL_WORLD_SIZE", 2)),
        strategy=PipelineStrategy(schedule=schedule, n_microbatches=m, **strategy),
        max_steps=steps,
        logger=False,
        enable_checkpointing=False,
        enable_progress_bar=False,
        enable_model_summary=False,
        num_sanity_val_steps=0,
        callbacks=callbacks,
    )


def machine() -> dict[str, Any]:
    return {
        "python": platform.python_version(),
        "torch": torch.__version__,
        "cpus": os.cpu_count(),
        "processor": platform.processor() or platform.machine(),
        "gpus": [torch.cuda.get_device_name(i) for i in range(torch.cuda.device_count())],
    }


def median_spread(values: list[float]) -> dict[str, float]:
    return {"median": statistics.median(values), "min": min(values), "max": max(values), "n": len(values)}
