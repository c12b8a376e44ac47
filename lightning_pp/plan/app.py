"""The planner: ``python -m lightning_pp.plan [the overrides of lightning_pp.train] [plan.memory_limit_mib=N]
[plan.top=K] [plan.verify_top=K]``, or ``plan_module`` from Python.

It profiles the model once in this process (each layer's forward, backward and split backward at three
micro-batch sizes, the activations each saves, its parameters, the optimizer's state and step), measures the
machine once on two ranks (``calibrate``) and fits the runtime's cost per action and per step to two short runs of
the model (``plan.calibrate_steps``), simulates every configuration for the devices (``planner``) and
writes ``plan.csv`` (best first, each row with the overrides that run it), ``plan.png`` and a table, into the
Hydra job's directory. ``plan.verify_top=K`` runs the first K through the app and adds what they measured.
With ``costs=<entered>`` it plans hardware this machine does not have from numbers typed in (not validated).
"""

from __future__ import annotations

import csv
import json
import logging
from collections.abc import Sequence
from dataclasses import replace
from pathlib import Path
from typing import Any

import hydra
import lightning as L
import torch
from hydra.core.hydra_config import HydraConfig
from hydra.utils import instantiate
from lightning.fabric.utilities.distributed import _suggested_max_num_threads
from lightning.pytorch.plugins.precision import Precision
from omegaconf import DictConfig

from lightning_pp.choose.costs import profile_module, profiled_sizes
from lightning_pp.choose.machine import Machine
from lightning_pp.choose.planner import Config, ModelCosts, Prediction, plan, predict
from lightning_pp.errors import PipelineConfigError
from lightning_pp.layout.schedule import check_microbatches
from lightning_pp.plan.calibrate import fit_nonnegative, launch, measure_machine
from lightning_pp.split.microbatch import batch_size_of
from lightning_pp.split.partition import uniform_split
from lightning_pp.split.profiling import Segments
from lightning_pp.train.app import check_config

log = logging.getLogger(__name__)

COLUMNS = [
    "rank", "schedule", "n_microbatches", "stages_per_rank", "balance", "activation_checkpointing",
    "pipeline_parallel_size", "predicted_step_s", "predicted_samples_per_s", "predicted_peak_mib", "predicted_bubble",
    "overrides",
]  # fmt: skip
# strategy keys every plan row sets: the user's own values for them are the planner's to choose
_CHOSEN = ("schedule", "pipeline_parallel_size", "stages_per_rank", "n_microbatches", "balance")
_CHOSEN += ("activation_checkpointing",)


def plan_module(
    module: L.LightningModule,
    batch: Any,
    devices: int,
    layers: str | None = None,
    memory_limit_mib: float | None = None,
    machine: Machine | None = None,
    **choices: Any,
) -> list[Prediction]:
    """Every configuration of ``module`` on ``devices`` CPU ranks for batches like ``batch``, best first (see
    ``planner.plan`` for ``choices``: schedules, pipeline_sizes, microbatches, activation_checkpointing)."""
    full = batch_size_of(batch)
    costs = profile_module(module, batch, layers, profiled_sizes(full))
    return plan(costs, machine or measure_machine(), devices, full, memory_limit_mib, **choices)


def _training_precision(trainer: DictConfig) -> Precision:
    """The precision plugin that ``trainer.precision`` (or its ``plugins``) gives the training runs: the profile
    runs the step as they will (bf16-mixed under autocast, bf16-true on bf16 weights)."""
    one = instantiate(trainer, devices=1, num_nodes=1, logger=False, enable_checkpointing=False)
    return one.precision_plugin


def entered_costs(cfg: DictConfig) -> tuple[ModelCosts, Machine]:
    """Costs typed in (``costs=<name>``): a layer's and the parts' times at one micro-batch size, bytes, and the
    machine's numbers; values scale with the micro-batch size."""
    n = cfg.n_layers

    def column(key: str) -> tuple[float, ...]:
        part = cfg[key]
        return (float(part.before), *[float(part.layer)] * n, float(part.after))

    seconds = {
        k: tuple(v * 1e-3 for v in column(f"{k}_ms")) for k in ("forward", "backward", "input_grad", "weight_grad")
    }
    segments = Segments(
        size=int(cfg.micro_batch_size),
        **seconds,
        saved_bytes=column("saved_bytes"),
        boundary_bytes=column("boundary_bytes"),
        param_bytes=column("param_bytes"),
    )  # type: ignore[arg-type]
    machine = Machine(**{k: float(v) for k, v in cfg.machine.items()})  # type: ignore[arg-type]
    return ModelCosts((segments,), float(cfg.optimizer_state_ratio), float(cfg.optimizer_s_per_byte)), machine


def write_plan(predictions: Sequence[Prediction], out: Path, measured: dict[int, float] | None = None) -> Path:
    """``plan.csv``: one row per configuration, best first."""
    measured = measured or {}
    path = out / "plan.csv"
    with path.open("w", newline="") as f:
        writer = csv.DictWriter(
            f, fieldnames=COLUMNS + (["measured_samples_per_s", "measured_step_s"] if measured else [])
        )
        writer.writeheader()
        for i, p in enumerate(predictions):
            c = p.config
            row: dict[str, Any] = {
                "rank": i + 1,
                "schedule": c.schedule,
                "n_microbatches": c.n_microbatches,
                "stages_per_rank": c.stages_per_rank,
                "balance": " ".join(map(str, c.balance)) + ("" if c.balance_mode == "uniform" else " (profile)"),
                "activation_checkpointing": c.activation_checkpointing,
                "pipeline_parallel_size": c.pipeline_parallel_size,
                "predicted_step_s": f"{p.step_s:.5f}",
                "predicted_samples_per_s": f"{p.samples_per_s:.2f}",
                "predicted_peak_mib": f"{p.peak_mib:.1f}",
                "predicted_bubble": f"{max(p.bubble):.3f}",
                "overrides": c.overrides(),
            }
            if i in measured:
                row["measured_samples_per_s"] = f"{measured[i]:.2f}"
                row["measured_step_s"] = f"{p.samples_per_s * p.step_s / measured[i]:.5f}"
            writer.writerow(row)
    return path


def plot_plan(
    predictions: Sequence[Prediction], png: Path, top: int = 25, measured: dict[int, float] | None = None
) -> Path:
    """Predicted samples/s and peak memory of the first ``top`` configurations (measured where verified)."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    shown = list(predictions[:top])
    labels = [_label(p) for p in shown]
    fig, (rate, memory) = plt.subplots(1, 2, figsize=(10, 0.28 * len(shown) + 1.6), sharey=True)
    ys = range(len(shown))
    rate.barh(ys, [p.samples_per_s for p in shown], color="tab:blue", label="predicted")
    for i, value in (measured or {}).items():
        if i < len(shown):
            rate.plot(value, i, "k|", markersize=12, mew=2, label="measured" if i == min(measured) else None)
    memory.barh(ys, [p.peak_mib for p in shown], color="tab:orange")
    rate.set_yticks(list(ys), labels, fontsize=7)
    rate.invert_yaxis()
    rate.set_xlabel("samples / s")
    memory.set_xlabel("peak MiB (worst rank)")
    rate.legend(fontsize=7, loc="lower right")
    fig.suptitle("Planned configurations, best first", fontsize=10)
    fig.tight_layout()
    fig.savefig(png, dpi=110)
    plt.close(fig)
    return png


def _label(p: Prediction) -> str:
    c = p.config
    extra = (", recompute" if c.activation_checkpointing else "") + (", profile" if c.balance_mode != "uniform" else "")
    return f"{c.schedule} pp{c.pipeline_parallel_size} v{c.stages_per_rank} m{c.n_microbatches}{extra}"


def table(predictions: Sequence[Prediction], top: int, measured: dict[int, float] | None = None) -> str:
    measured = measured or {}
    lines = [
        f"{'#':>3}  {'configuration':<44} {'step s':>8} {'samples/s':>10} {'peak MiB':>9}"
        + ("  measured/s" if measured else "")
    ]
    for i, p in enumerate(predictions[:top]):
        line = f"{i + 1:>3}  {_label(p):<44} {p.step_s:>8.4f} {p.samples_per_s:>10.1f} {p.peak_mib:>9.1f}"
        lines.append(line + (f"  {measured[i]:>10.1f}" if i in measured else ""))
    return "\n".join(lines)


def verify(
    predictions: Sequence[Prediction],
    k: int,
    overrides: Sequence[str],
    out: Path,
    steps: int,
    batch_size: int,
    ranks: int,
) -> dict[int, float]:
    """Run the first ``k`` configurations through the app (the user's overrides, the row's, a short fit, on
    ``ranks`` local processes, one launch) and read the samples/s each measured (over every replica, as
    predicted)."""
    shown = predictions[:k]
    jobs = [out / "verify" / str(i + 1) for i in range(len(shown))]
    launch([(_short_run(p.config, overrides, steps), job) for p, job in zip(shown, jobs)], ranks)
    return {i: p.samples_per_s * p.step_s / _step_s(job, batch_size) for i, (p, job) in enumerate(zip(shown, jobs))}


def calibration_runs(costs: ModelCosts, devices: int, batch_size: int) -> list[Config]:
    """The three short runs of the model that the runtime's costs are fitted to: 1F1B with the fewest and with the
    most micro-batches (up to 8 per stage), and the interleaved zero-bubble schedule (two messages per forward,
    weight halves without any)."""
    pp = min(p for p in range(2, devices + 1) if devices % p == 0)
    v = 2 if costs.n_layers >= 2 * pp else 1
    divisors = [m for m in range(1, batch_size + 1) if batch_size % m == 0]
    runs = [
        Config(pp, "1f1b", 1, next((m for m in divisors if m >= pp), divisors[-1]), (), "uniform", False),
        Config(pp, "1f1b", 1, max(m for m in divisors if m <= 8 * pp), (), "uniform", False),
    ]
    zero_bubble = [m for m in divisors if m <= 4 * pp * v and _accepted("interleaved_zb", m, pp, pp * v)]
    if v == 2 and zero_bubble:
        runs.append(Config(pp, "interleaved_zb", 2, max(zero_bubble), (), "uniform", False))
    return [replace(c, balance=tuple(uniform_split(costs.n_layers, pp * c.stages_per_rank))) for c in runs]


def fit_runtime(
    costs: ModelCosts, machine: Machine, runs: Sequence[Config], step_s: Sequence[float], devices: int, batch_size: int
) -> Machine:
    """The runtime's own time per action, per message and per step that explain the measured ``step_s`` of the
    ``runs`` best through the simulator (least squares, none negative). The tiny model of ``calibrate`` misses what
    grows with a real model: its optimizer's and Lightning's step, the runtime's bookkeeping per action and per
    message."""

    def simulated(config: Config, action: float, message: float) -> float:
        trial = replace(machine, action_overhead_s=action, message_overhead_s=message, step_overhead_s=0.0)
        return predict(config, costs, trial, batch_size, devices).step_s

    base = [simulated(c, 0.0, 0.0) for c in runs]
    rows = [
        [(simulated(c, 1e-3, 0.0) - b) / 1e-3, (simulated(c, 0.0, 1e-3) - b) / 1e-3, 1.0] for c, b in zip(runs, base)
    ]
    action, message, step = fit_nonnegative(rows, [m - b for m, b in zip(step_s, base)])
    log.info("Runtime costs fitted to %d runs of the model: %.3g ms per action, %.3g ms per message, %.3g ms per"
             " step.", len(runs), 1e3 * action, 1e3 * message, 1e3 * step)  # fmt: skip
    return replace(machine, action_overhead_s=action, message_overhead_s=message, step_overhead_s=step)


def _accepted(schedule: str, m: int, pp: int, n_stages: int) -> bool:
    try:
        check_microbatches(schedule, m, pp, n_stages)
    except PipelineConfigError:
        return False
    return True


def _short_run(config: Config, overrides: Sequence[str], steps: int) -> list[str]:
    """The app's overrides that run ``config`` for ``steps`` steps with the user's overrides (those the plan
    chooses, and the planner's own, left out)."""
    mine = [o for o in overrides if not o.split("=")[0].lstrip("+~").startswith(("plan.", "costs", "hydra"))]
    mine = [o for o in mine if o.split("=")[0].lstrip("+~") not in {f"strategy.{k}" for k in _CHOSEN}]
    short = [f"trainer.max_steps={steps}", "trainer.limit_val_batches=0", "trainer.num_sanity_val_steps=0",
             "trainer.enable_progress_bar=false"]  # fmt: skip
    return [*mine, *short, *config.overrides().split()]


def _step_s(job: Path, batch_size: int) -> float:
    """Seconds per step a run measured (``batch_size`` samples per replica)."""
    return batch_size / json.loads((job / "result.json").read_text())["samples_per_s"]


def run(cfg: DictConfig) -> Path:
    out = Path(HydraConfig.get().runtime.output_dir)
    settings = cfg.plan
    choices = {k: list(settings[k]) for k in ("schedules", "pipeline_sizes", "microbatches") if settings.get(k)}
    choices["activation_checkpointing"] = list(settings.activation_checkpointing)
    overrides = list(HydraConfig.get().overrides.task)
    ranks = int(cfg.trainer.devices)  # this machine's processes, as training starts them
    if cfg.get("costs"):
        costs, machine = entered_costs(cfg.costs)
        devices, batch_size = int(cfg.costs.devices), int(cfg.costs.batch_size)
        log.warning("Planning from entered costs (%s): not validated on this machine.", cfg.costs.get("name", "costs"))
    else:
        check_config(cfg)
        devices = ranks * int(cfg.trainer.get("num_nodes", 1))
        torch.set_num_threads(_suggested_max_num_threads(ranks))  # what each rank gets
        L.seed_everything(cfg.seed, verbose=False)
        module = instantiate(cfg.model)
        module.configure_model()
        data = instantiate(cfg.data)
        data.setup("fit")
        batch = next(iter(data.train_dataloader()))
        batch_size = batch_size_of(batch)
        precision = _training_precision(cfg.trainer)
        with precision.train_step_context():
            module = precision.convert_module(module)
            costs = profile_module(module, batch, cfg.strategy.layers, profiled_sizes(batch_size))
        # the machine and the calibration runs in one launch of the ranks
        runs = calibration_runs(costs, devices, batch_size) if settings.calibrate_steps else []
        jobs = [out / "calibrate" / str(i) for i in range(len(runs))]
        short = [_short_run(c, overrides, settings.calibrate_steps) for c in runs]
        machine = measure_machine(cfg.trainer.accelerator, ranks, list(zip(short, jobs)), timeout_s=None)
        if runs:
            machine = fit_runtime(costs, machine, runs, [_step_s(j, batch_size) for j in jobs], devices, batch_size)
    predictions = plan(costs, machine, devices, batch_size, settings.memory_limit_mib, **choices)
    if not predictions:
        raise ValueError(f"No configuration fits plan.memory_limit_mib={settings.memory_limit_mib}; raise it.")
    measured = {}
    if settings.verify_top:
        measured = verify(predictions, settings.verify_top, overrides, out, settings.verify_steps, batch_size, ranks)
    path = write_plan(predictions, out, measured)
    plot_plan(predictions, out / "plan.png", measured=measured)
    (out / "costs.json").write_text(
        json.dumps({"machine": machine.__dict__, "devices": devices, "batch_size": batch_size}, indent=1)
    )
    print(table(predictions, settings.top, measured))
    print(f"plan: {path}")
    return path


@hydra.main(version_base="1.3", config_path="pkg://lightning_pp.conf", config_name="plan")
def main(cfg: DictConfig) -> None:
    run(cfg)
