"""One rank of a sharding run (launch with torchrun on 4 processes): dp=2 x pp=2, the example GPT built on meta,
AdamW in fp32, a few 1F1B steps under ``data_parallel=MODE`` (ddp | fsdp) and ``fsdp_reshard=RESHARD``.

    torchrun --nproc_per_node 4 run_sharding.py MODE RESHARD CONFIG_JSON OUT
    torchrun --nproc_per_node 4 run_sharding.py collectives - CONFIG_JSON OUT


Each rank measures its peak resident memory growth during ``fit`` (VmHWM after ``echo 5 > clear_refs`` just
before ``fit``, minus VmRSS then, as tests/job.py's ``Usage``), also per step (the peak is read and restarted at
every step's start, so the overall peak is the max of the pieces), and rank 0 the wall time between consecutive
``on_train_batch_end``. Each rank also counts its stage's parameters (logical sizes: a sharded Parameter counts
whole), its largest layer, and the bytes it holds locally of parameters and optimizer state. Rank 0 writes
every rank's row to OUT.

``collectives`` times, with plain torch.distributed, what the modes communicate for one layer (its parameters
as one fp32 buffer) within each stage's replica group ({0, 2} and {1, 3}, both groups at once as in training):
DDP's all-reduce, FSDP's all-gather (into a fresh buffer, as FSDP allocates one per unshard, and into a reused
one) and reduce-scatter.
"""

from __future__ import annotations

import json
import os
import sys
import time

import torch
import torch.distributed as dist
from common import proc_kib
from lightning.pytorch.callbacks import Callback
from torch.utils.data import DataLoader

from lightning_pp.examples.gpt import GPT
from lightning_pp.layout.dtensors import local_tensor


def _restart_peak() -> None:
    with open("/proc/self/clear_refs", "w") as f:
        f.write("5")  # VmHWM restarts from the current VmRSS


class Usage(Callback):
    """Peak RSS growth from ``start()`` (just before fit), overall and per step; step end times."""

    def start(self) -> None:
        _restart_peak()
        self.rss_before = proc_kib("VmRSS:") * 1024
        self.peak = self.rss_before
        self.step_peaks: list[int] = []  # growth over rss_before, per step (each step's own peak)
        self.step_rss: list[int] = []  # growth over rss_before at each step's end
        self.ends: list[float] = []

    def _fold(self) -> int:
        hwm = proc_kib("VmHWM:") * 1024
        self.peak = max(self.peak, hwm)
        return hwm

    def on_train_batch_start(self, trainer, pl_module, batch, batch_idx) -> None:
        self._fold()  # the peak of setup (first step) or of the gap between steps, kept in self.peak
        _restart_peak()

    def on_train_batch_end(self, trainer, pl_module, outputs, batch, batch_idx) -> None:
        self.ends.append(time.perf_counter())
        self.step_peaks.append(self._fold() - self.rss_before)
        self.step_rss.append(proc_kib("VmRSS:") * 1024 - self.rss_before)

    def on_train_end(self, trainer, pl_module) -> None:
        self._fold()
        self.peak_growth = self.peak - self.rss_before


def stage_counts(model: torch.nn.Module, optimizer: torch.optim.Optimizer) -> dict[str, int]:
    """What this rank holds after fit: its stage's parameters (logical numel), the largest layer, and the bytes
    it holds locally (a shard under FSDP) of parameters and of optimizer state."""
    params = list(model.parameters())
    layers = [m for m in model.layers.values() if m is not None]
    state = [t for s in optimizer.state.values() for t in s.values() if isinstance(t, torch.Tensor)]
    return {
        "stage_params": sum(p.numel() for p in params),
        "stage_layers": len(layers),
        "largest_layer_params": max((sum(p.numel() for p in m.parameters()) for m in layers), default=0),
        "non_layer_params": sum(p.numel() for p in params) - sum(p.numel() for m in layers for p in m.parameters()),
        "local_param_bytes": sum(local_tensor(p).numel() * p.element_size() for p in params),
        "local_optimizer_state_bytes": sum(local_tensor(t).numel() * t.element_size() for t in state if t.dim() > 0),
    }


def collectives(cfg: dict, out: str, reps: int = 4) -> None:
    dist.init_process_group("gloo")
    rank, world, pp = dist.get_rank(), dist.get_world_size(), cfg["pp"]
    groups = [dist.new_group(list(range(s, world, pp))) for s in range(pp)]  # replicas of each stage
    group = groups[rank % pp]
    d = dist.get_world_size(group)
    with torch.device("meta"):
        layer = GPT(**{k: cfg[k] for k in ("vocab", "dim", "n_layers", "n_heads", "seq_len")}).layers["0"]
    n = sum(p.numel() for p in layer.parameters()) // d * d
    full, shard, reused = torch.randn(n), torch.randn(n // d), torch.empty(n)

    def timed(fn) -> float:
        fn()  # warm-up
        dist.barrier()
        start = time.perf_counter()
        for _ in range(reps):
            fn()
        dist.barrier()
        return (time.perf_counter() - start) / reps

    seconds = {
        "all_reduce": timed(lambda: dist.all_reduce(full, group=group)),
        "all_gather_fresh_buffer": timed(lambda: dist.all_gather_into_tensor(torch.empty(n), shard, group=group)),
        "all_gather_reused_buffer": timed(lambda: dist.all_gather_into_tensor(reused, shard, group=group)),
        "reduce_scatter": timed(lambda: dist.reduce_scatter_tensor(torch.empty(n // d), full, group=group)),
    }
    if rank == 0:
        with open(out, "w") as f:
            json.dump({"layer_params": n, "layer_bytes": 4 * n, "replicas": d, "seconds_per_layer": seconds}, f)
    dist.destroy_process_group()


if __name__ == "__main__":
    mode, reshard, cfg, out = sys.argv[1], sys.argv[2], json.loads(sys.argv[3]), sys.argv[4]
    torch.set_num_threads(1)
    if mode == "collectives":
        collectives(cfg, out)
        sys.exit(0)
    import lightning as L

    from lightning_pp import PipelineStrategy

    L.seed_everything(0, verbose=False)
    usage = Usage()
    trainer = L.Trainer(
        accelerator="cpu",
        devices=int(os.environ["LOCAL_WORLD_SIZE"]),
        strategy=PipelineStrategy(
            schedule=cfg["schedule"],
            n_microbatches=cfg["m"],
            pipeline_parallel_size=cfg["pp"],
            data_parallel=mode,
            fsdp_reshard=reshard,
        ),
        max_steps=cfg["steps"],
        limit_val_batches=0,
        logger=False,
        enable_checkpointing=False,
        enable_progress_bar=False,
        enable_model_summary=False,
        num_sanity_val_steps=0,
        callbacks=[usage],
    )
    model_cfg = {k: cfg[k] for k in ("vocab", "dim", "n_layers", "n_heads", "seq_len")}
    with trainer.init_module(empty_init=True):
        model = GPT(**model_cfg, lr=1e-4)  # configure_optimizers: AdamW (fp32, two states per parameter)
    whole = sum(p.numel() for p in model.parameters())
    g = torch.Generator().manual_seed(0)
    dp = int(os.environ["WORLD_SIZE"]) // cfg["pp"]
    n = cfg["steps"] * dp * cfg["batch"]
    data = torch.randint(0, cfg["vocab"], (n, cfg["seq_len"] + 1), generator=g)
    loader = DataLoader(list(zip(data[:, :-1], data[:, 1:])), batch_size=cfg["batch"])  # per replica
    usage.start()
    trainer.fit(model, loader)
    row = {
        "rank": trainer.global_rank,
        "peak_growth": usage.peak_growth,
        "rss_before": usage.rss_before,
        "step_peaks": usage.step_peaks,
        "step_rss": usage.step_rss,
        "ends": usage.ends,
        "threads": torch.get_num_threads(),
        **stage_counts(model, trainer.optimizers[0]),
    }
    rows: list = [None] * dist.get_world_size()
    dist.all_gather_object(rows, row)
    if dist.get_rank() == 0:
        with open(out, "w") as f:
            json.dump({"whole_params": whole, "ranks": rows}, f)
