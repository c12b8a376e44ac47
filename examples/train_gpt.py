"""Train the example GPT as a 2-stage pipeline on CPU: ``python examples/train_gpt.py``."""

import argparse
import os
import sys

import lightning as L

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))

from gpt import GPT, loaders  # noqa: E402

import lightning_pp  # noqa: E402,F401  (registers strategy="pipeline")
from lightning_pp import PipelineStrategy  # noqa: E402

if __name__ == "__main__":
    parser = argparse.ArgumentParser()
    parser.add_argument("--devices", type=int, default=2)
    parser.add_argument("--schedule", default="1f1b")
    parser.add_argument("--n-microbatches", type=int, default=4)
    parser.add_argument("--epochs", type=int, default=3)
    args = parser.parse_args()
    L.seed_everything(0)
    train, val = loaders()
    trainer = L.Trainer(
        accelerator="cpu",
        devices=args.devices,
        strategy=PipelineStrategy(schedule=args.schedule, n_microbatches=args.n_microbatches),
        max_epochs=args.epochs,
        log_every_n_steps=8,
        enable_checkpointing=True,
    )
    model = GPT()
    before = trainer.validate(model, val, verbose=False)[0]["val_loss"]
    trainer.fit(model, train, val)
    after = float(trainer.callback_metrics["val_loss"])
    if trainer.is_global_zero:
        print(f"val_loss before training {before:.3f}, after {args.epochs} epochs {after:.3f}")
