"""The Hydra app: ``python -m lightning_pp.train [overrides]`` (``-m`` for sweeps).

One job seeds, builds strategy, model, data, trainer, logger and callbacks from ``conf/`` by
instantiation (the model on the meta device, so no process ever holds it whole), fits, validates,
and writes into the job's directory the Lightning logs, a
``result.json`` (rank 0) and a ``rank{r}.json`` from every rank, so anyone can check that each
rank ran the job's own configuration.
"""

from __future__ import annotations

import contextlib
import gc
import json
import logging
import os
import time
import warnings
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import hydra
import lightning as L
import torch
import torch.distributed as dist
from hydra.core.hydra_config import HydraConfig
from hydra.utils import instantiate
from lightning.pytorch.callbacks import Callback, ModelCheckpoint
from omegaconf import DictConfig, OmegaConf

from lightning_pp.callbacks import PipelineMonitor
from lightning_pp.errors import PipelineConfigError
from lightning_pp.layout.options import AUTO
from lightning_pp.layout.schedule import resolve_stages_per_rank
from lightning_pp.lifecycle.exit import close_process_groups
from lightning_pp.split.microbatch import batch_size_of, tokens_in
from lightning_pp.strategy import PipelineStrategy
from lightning_pp.train.replica_groups import fault_tolerance, run_local_groups

_CHILD_EXIT_S = 120


class Throughput(Callback):
    """Samples (and tokens) per second between training-batch ends, after the warm-up steps."""

    def __init__(self, warmup: int = 2) -> None:
        self.warmup = warmup
        self.ends: list[float] = []
        self.samples: list[int] = []
        self.tokens: list[int | None] = []

    def on_train_batch_end(self, trainer: L.Trainer, pl_module: L.LightningModule, outputs: Any, batch: Any, *_: Any):
        self.ends.append(time.perf_counter())
        self.samples.append(batch_size_of(batch))
        self.tokens.append(tokens_in(batch))

    def rates(self) -> tuple[float | None, float | None]:
        skip = min(self.warmup, len(self.ends) - 2)  # keep at least one interval
        if skip < 0:
            return None, None
        span = self.ends[-1] - self.ends[skip]
        tokens = self.tokens[skip + 1 :]
        samples_per_s = sum(self.samples[skip + 1 :]) / span
        tokens_per_s = None if None in tokens else sum(tokens) / span  # type: ignore[arg-type]
        return samples_per_s, tokens_per_s


def check_config(cfg: DictConfig) -> None:
    """Overrides that cannot work, named by their config key, before any process starts."""
    schedule, stages_per_rank = cfg.strategy.schedule, cfg.strategy.get("stages_per_rank")
    try:  # "auto": the first batch chooses, one stage per rank at least
        per_rank = 1 if AUTO in (schedule, stages_per_rank) else resolve_stages_per_rank(schedule, stages_per_rank)
    except PipelineConfigError as error:
        raise PipelineConfigError(f"strategy.schedule={cfg.strategy.schedule}: {error}") from None
    devices, nodes = cfg.trainer.get("devices"), cfg.trainer.get("num_nodes", 1)
    if not isinstance(devices, int):
        return
    world = devices * nodes
    ranks = cfg.strategy.get("pipeline_parallel_size") or world
    if world % ranks:
        raise PipelineConfigError(
            f"strategy.pipeline_parallel_size={ranks} does not divide trainer.devices x trainer.num_nodes ="
            f" {devices} x {nodes} = {world}; choose a stage count that divides {world}."
        )
    stages = ranks * per_rank
    n_layers = cfg.model.get("n_layers")
    if isinstance(n_layers, int) and n_layers < stages:
        raise PipelineConfigError(
            f"model.n_layers={n_layers} is less than the {stages} pipeline stages ({ranks} ranks x {per_rank}"
            f" stages per rank); use more layers or fewer devices."
        )


@contextlib.contextmanager
def job_scope() -> Iterator[None]:
    """Leave the process as the job found it, so that the next job of a sweep starts its own ranks, and start
    without what the job before left.

    After a job, rank 0 still holds LOCAL_RANK, MASTER_PORT and friends; the next job's Trainer
    would then think its processes were started externally, start none and wait for them. The job before's
    Trainer, model and stages are cyclic garbage that Python's collector would carry into this job's steps: a
    third job of the same configuration in one process stepped up to 20% slower than the first (a sweep's
    throughput, the planner's runs), and as fast after a collection.
    """
    gc.collect()
    environment = dict(os.environ)
    try:
        yield
    finally:
        if dist.is_initialized():
            dist.destroy_process_group()
        os.environ.clear()
        os.environ.update(environment)


def run(cfg: DictConfig) -> dict[str, Any]:
    check_config(cfg)
    L.seed_everything(cfg.seed, workers=True)
    out = Path(HydraConfig.get().runtime.output_dir)
    throughput = Throughput()
    callbacks = [instantiate(c) for c in (cfg.get("callbacks") or {}).values()] + [throughput]
    if cfg.get("monitor"):
        callbacks.append(PipelineMonitor())
    if cfg.get("samples"):
        callbacks.append(instantiate(cfg.samples))
    logger = instantiate(cfg.logger) if cfg.get("logger") else False
    ft = fault_tolerance(cfg)  # ft=group: this job is one replica group
    strategy = instantiate(cfg.strategy, **({"fault_tolerance": ft} if ft else {}))
    trainer: L.Trainer = instantiate(cfg.trainer, strategy=strategy, logger=logger, callbacks=callbacks)
    with trainer.init_module(empty_init=True):  # parameters on meta: each rank materialises only its stage
        model = instantiate(cfg.model)
    data = instantiate(cfg.data)

    start = time.perf_counter()
    resume = resume_from(cfg.get("resume"), trainer)
    trainer.fit(model, datamodule=data, ckpt_path=resume, weights_only=cfg.get("weights_only"))
    train_loss = trainer.callback_metrics.get("train_loss")
    # the final weights' val_loss for result.json, kept from the loggers: it would end metrics.csv with a row one
    # epoch past the last trained, which no fit wrote
    loggers, trainer.loggers = trainer.loggers, []
    validated = trainer.validate(model, datamodule=data, verbose=False)  # empty under limit_val_batches=0
    trainer.loggers = loggers
    val_loss = validated[0].get("val_loss") if validated else None
    wall = time.perf_counter() - start

    rank = trainer.global_rank
    (out / f"rank{rank}.json").write_text(
        json.dumps(
            {
                "rank": rank,
                "world_size": trainer.world_size,
                "pid": os.getpid(),
                "cluster_environment": type(trainer.strategy.cluster_environment).__name__,
                "strategy": OmegaConf.to_container(cfg.strategy, resolve=True),
                "threads": torch.get_num_threads(),
                "train_loss": None if train_loss is None else float(train_loss),
                "val_loss": val_loss,
            },
            indent=1,
        )
    )
    result: dict[str, Any] = {}
    if trainer.is_global_zero:
        samples_per_s, tokens_per_s = throughput.rates()
        batch = getattr(data, "batch_size", None)
        n_microbatches = (
            strategy.microbatches_for(batch)
            if isinstance(strategy, PipelineStrategy) and isinstance(batch, int)
            else cfg.strategy.get("n_microbatches")
        )
        result = {
            "schedule": getattr(strategy, "schedule", None),
            "stages": getattr(strategy, "n_stages", 1),
            "n_microbatches": n_microbatches,
            "world_size": trainer.world_size,
            "train_loss": None if train_loss is None else float(train_loss),
            "val_loss": val_loss,
            "samples_per_s": samples_per_s,
            "tokens_per_s": tokens_per_s,
            "wall_s": wall,
            "overrides": list(HydraConfig.get().overrides.task),
        }
        (out / "result.json").write_text(json.dumps(result, indent=1))
    close_process_groups()  # with every rank of the job, before rank 0 waits for the others to exit
    for child in getattr(trainer.strategy.launcher, "procs", []):
        child.wait(timeout=_CHILD_EXIT_S)
    return result


def resume_from(resume: str | None, trainer: L.Trainer) -> str | None:
    """``resume=last`` where a checkpoint callback of this run has written a ``last`` checkpoint (Lightning then
    takes the newest), else a fresh start without Lightning's warning that there was nothing to resume."""
    if resume != "last":
        return resume
    found = any(
        c._find_last_checkpoints(trainer) for c in trainer.checkpoint_callbacks if isinstance(c, ModelCheckpoint)
    )
    return "last" if found else None


@contextlib.contextmanager
def lightning_logs_in_job_file() -> Iterator[None]:
    """Lightning's loggers (``lightning.pytorch``, with lightning_pp's beneath it, and ``lightning.fabric``) print
    by themselves and do not propagate when imported before logging is configured, as the app imports them before
    Hydra configures the job's: without the job's log file among their handlers, that file (``train.log``,
    ``train_rank{r}.log``) stays empty. Removed after the job: the next job of a sweep has a file of its own."""
    files = [h for h in logging.getLogger().handlers if isinstance(h, logging.FileHandler)]
    loggers = [logging.getLogger(name) for name in ("lightning.pytorch", "lightning.fabric")]
    loggers = [logger for logger in loggers if not logger.propagate]
    for logger in loggers:
        for handler in files:
            logger.addHandler(handler)
    try:
        yield
    finally:
        for logger in loggers:
            for handler in files:
                logger.removeHandler(handler)


@hydra.main(version_base="1.3", config_path="pkg://lightning_pp.conf", config_name="config")
def main(cfg: DictConfig) -> None:
    # Lightning's own data loops, under torch 2.13, warn of torch's deprecated LeafSpec at every loop's start
    # (with any strategy): nothing the app's user can act on
    warnings.filterwarnings("ignore", message=r"`isinstance\(treespec, LeafSpec\)` is deprecated")
    if cfg.ft.mode == "local":  # this process serves the lighthouse and starts the replica groups
        hydra_cfg = HydraConfig.get()
        code = run_local_groups(cfg, Path(hydra_cfg.runtime.output_dir), list(hydra_cfg.overrides.task))
        if code:
            raise SystemExit(code)
        return
    with job_scope(), lightning_logs_in_job_file():
        run(cfg)
