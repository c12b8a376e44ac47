"""The end of a Hydra multirun: one ``summary.csv`` row per job, and ``summary.png`` drawn from it."""

from __future__ import annotations

import csv
import json
import logging
from collections import defaultdict
from pathlib import Path
from typing import Any

from hydra.experimental.callback import Callback
from omegaconf import DictConfig

log = logging.getLogger(__name__)

COLUMNS = ["job", "schedule", "stages", "n_microbatches", "train_loss", "val_loss", "samples_per_s", "wall_s"]
# overrides already shown by a fixed column
_SHOWN = {"strategy.schedule", "strategy.n_microbatches"}


def write_summary(sweep_dir: Path) -> Path:
    """``summary.csv`` from the ``result.json`` of every job below ``sweep_dir``."""
    rows: list[dict[str, Any]] = []
    for result_file in sorted(sweep_dir.glob("*/result.json"), key=lambda p: _job_order(p.parent.name)):
        result = json.loads(result_file.read_text())
        row = {"job": result_file.parent.name, **{k: result.get(k) for k in COLUMNS[1:]}}
        for override in result.get("overrides", []):
            key, _, value = override.partition("=")
            key = key.lstrip("+~")
            if key not in _SHOWN:
                row[key] = value
        rows.append(row)
    extra = sorted({k for row in rows for k in row} - set(COLUMNS))
    path = sweep_dir / "summary.csv"
    with path.open("w", newline="") as f:
        writer = csv.DictWriter(f, fieldnames=COLUMNS + extra)
        writer.writeheader()
        writer.writerows(rows)
    return path


def plot_summary(csv_path: Path, png_path: Path) -> Path:
    """Samples/s against micro-batch count, one line per schedule and stage count.

    Dashed: the shape the bubble bound predicts, a rate proportional to m / (m + p - 1), scaled to
    the measured rate at the largest m of each line.
    """
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    series: dict[tuple[str, int], list[tuple[int, float]]] = defaultdict(list)
    with csv_path.open() as f:
        for row in csv.DictReader(f):
            if row["samples_per_s"] and row["n_microbatches"]:
                key = (row["schedule"], int(row["stages"]))
                series[key].append((int(row["n_microbatches"]), float(row["samples_per_s"])))
    fig, ax = plt.subplots(figsize=(6.4, 4.2))
    for (schedule, stages), points in sorted(series.items()):
        points.sort()
        ms, rates = [m for m, _ in points], [r for _, r in points]
        (line,) = ax.plot(ms, rates, marker="o", label=f"{schedule}, {stages} stages")
        m_max, r_max = ms[-1], rates[-1]
        scale = r_max / (m_max / (m_max + stages - 1))
        ax.plot(ms, [scale * m / (m + stages - 1) for m in ms], linestyle="--", color=line.get_color(), alpha=0.6)
    ax.set_xscale("log", base=2)
    ticks = sorted({m for points in series.values() for m, _ in points})
    ax.set_xticks(ticks, [str(m) for m in ticks])
    ax.set_xlabel("micro-batches per batch (m)")
    ax.set_ylabel("samples / s")
    ax.set_title("Throughput against micro-batch count (dashed: bubble bound m/(m+p-1))", fontsize=9)
    ax.grid(alpha=0.3)
    ax.legend(fontsize=8)
    fig.tight_layout()
    fig.savefig(png_path, dpi=120)
    plt.close(fig)
    return png_path


class SweepSummary(Callback):
    """Hydra callback: after a multirun, summarise the jobs in the sweep directory."""

    def on_multirun_end(self, config: DictConfig, **kwargs: Any) -> None:
        sweep_dir = Path(config.hydra.sweep.dir)
        if not sweep_dir.is_dir():
            return
        csv_path = write_summary(sweep_dir)
        try:
            png_path = plot_summary(csv_path, sweep_dir / "summary.png")
        except ImportError:
            log.warning("matplotlib is not installed: wrote %s without summary.png", csv_path)
            return
        # printed, not logged: the last job's logging is still configured and would take it into that job's log
        print(f"Sweep summary: {csv_path} (one row per job) and {png_path}", flush=True)


def _job_order(name: str) -> tuple[int, str]:
    return (int(name), name) if name.isdigit() else (1 << 30, name)
