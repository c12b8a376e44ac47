"""LightningCLI: every ``PipelineStrategy`` argument from the command line or a YAML file (jsonargparse reads the
signature, ``"auto"`` included), and a fit launched that way trains as the same CLI's one-process fit."""

from __future__ import annotations

import csv
from datetime import timedelta
from pathlib import Path

from conftest import run_script
from lightning.pytorch.cli import LightningCLI
from test_parity import LOSS_TOL

from lightning_pp import PipelineStrategy
from lightning_pp.examples.data import ProgressionsData
from lightning_pp.examples.gpt import GPT

SCRIPT = """
from lightning.pytorch.cli import LightningCLI

import lightning_pp  # noqa: F401  (registers strategy="pipeline")
from lightning_pp.examples.data import ProgressionsData
from lightning_pp.examples.gpt import GPT

LightningCLI(GPT, ProgressionsData)
"""

CONFIG = """
trainer:
  devices: 2
  strategy:
    class_path: lightning_pp.PipelineStrategy
    init_args:
      schedule: zbv
      n_microbatches: 4
"""


def _parsed(args: list[str]) -> PipelineStrategy:
    """The Trainer's strategy as LightningCLI builds it, in this process: no fit, and no seed (which would set
    ``PL_GLOBAL_SEED`` for the one-process references that later tests run here)."""
    cli = LightningCLI(GPT, ProgressionsData, run=False, args=args, seed_everything_default=False)
    assert isinstance(cli.trainer.strategy, PipelineStrategy)
    return cli.trainer.strategy


def test_every_strategy_argument_reaches_the_strategy_from_the_command_line():
    args = ["--trainer.accelerator=cpu", "--trainer.devices=2", "--trainer.strategy=lightning_pp.PipelineStrategy",
            "--trainer.strategy.schedule=interleaved_1f1b", "--trainer.strategy.n_microbatches=auto",
            "--trainer.strategy.stages_per_rank=2", "--trainer.strategy.balance=[1,1,1,1]",
            "--trainer.strategy.activation_checkpointing=auto", "--trainer.strategy.memory_limit=80%",
            "--trainer.strategy.timeout=120", "--trainer.strategy.compile={mode: max-autotune-no-cudagraphs}",
            "--trainer.strategy.state_dict_type=sharded"]  # fmt: skip
    o = _parsed(args).options
    assert (o.schedule, o.stages_per_rank, list(o.balance), o.memory_limit) == ("interleaved_1f1b", 2, [1] * 4, "80%")
    assert o.auto == {"n_microbatches", "activation_checkpointing"}
    assert o.timeout == timedelta(seconds=120) and o.compile == {"mode": "max-autotune-no-cudagraphs"}
    assert o.state_dict_type == "sharded"
    assert _parsed(["--trainer.strategy=pipeline"]).options.schedule == "1f1b"  # the registered name


def _losses(path: Path) -> list[float]:
    with path.open() as f:
        return [float(r["train_loss"]) for r in csv.DictReader(f) if r.get("train_loss")]


def test_a_fit_from_a_yaml_config_trains_as_the_same_clis_one_process_fit(tmp_path):
    (tmp_path / "main.py").write_text(SCRIPT)
    (tmp_path / "pipeline.yaml").write_text(CONFIG)
    shared = ["--seed_everything=0", "--trainer.accelerator=cpu", "--trainer.max_steps=6", "--trainer.logger=CSVLogger",
              "--trainer.log_every_n_steps=1", "--trainer.enable_progress_bar=false", "--data.n_train=96",
              "--data.n_val=16", "--model.dim=32"]  # fmt: skip
    pipeline = ["fit", "--config=pipeline.yaml", *shared, "--trainer.logger.save_dir=pipe"]
    code, output = run_script(tmp_path / "main.py", 300, ranks=2, argv=pipeline)
    assert code == 0, output[-3000:]
    assert "Pipeline placement (4 stages" in output, output[-3000:]  # ZBV: two stages on each of the two ranks
    # one process under DDP: its DistributedSampler draws the shuffle every stage of the pipeline draws (seeded by
    # seed_everything), where a plain one-device fit's RandomSampler draws from the global RNG
    one = ["fit", *shared, "--trainer.devices=1", "--trainer.strategy=ddp", "--trainer.logger.save_dir=one"]
    code, output = run_script(tmp_path / "main.py", 300, argv=one)
    assert code == 0, output[-3000:]
    got, expected = (_losses(next((tmp_path / d).rglob("metrics.csv"))) for d in ("pipe", "one"))
    assert len(got) == len(expected) == 6, (got, expected)
    assert max(abs(a - b) for a, b in zip(got, expected)) <= LOSS_TOL, (got, expected)
