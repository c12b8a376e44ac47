"""Train the example GPT as a 2-stage pipeline on CPU with plain Lightning (no Hydra).

python examples/train_gpt.py --devices 2 --schedule gpipe --n-microbatches 4
"""

import argparse

import lightning as L

import lightning_pp  # noqa: F401  (registers strategy="pipeline")
from lightning_pp import PipelineStrategy
from lightning_pp.examples.data import ProgressionsData
from lightning_pp.examples.gpt import GPT

if __name__ == "__main__":
    parser = argparse.ArgumentParser()
    parser.add_argument("--devices", type=int, default=2)
    parser.add_argument("--schedule", default="1f1b")
    parser.add_argument("--n-microbatches", type=int, default=4)
    parser.add_argument("--epochs", type=int, default=3)
    args = parser.parse_args()
    L.seed_everything(0)
    trainer = L.Trainer(
        accelerator="cpu",
        devices=args.devices,
        strategy=PipelineStrategy(schedule=args.schedule, n_microbatches=args.n_microbatches),
        max_epochs=args.epochs,
        log_every_n_steps=8,
    )
    model, data = GPT(), ProgressionsData()
    before = trainer.validate(model, datamodule=data, verbose=False)[0]["val_loss"]
    trainer.fit(model, datamodule=data)
    after = float(trainer.callback_metrics["val_loss"])
    if trainer.is_global_zero:
        print(f"val_loss before training {before:.3f}, after {args.epochs} epochs {after:.3f}")
