"""validate, test, fit, test, validate with one Trainer in one process; writes what each call logged."""

from __future__ import annotations

import json
import os
import sys
from pathlib import Path
from typing import Any

import lightning as L
import torch

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))

from models import TinyGPT, loader  # noqa: E402

import lightning_pp  # noqa: E402,F401


def run(cfg: dict[str, Any]) -> dict[str, Any]:
    out = Path(cfg["out"])
    out.mkdir(parents=True, exist_ok=True)
    if cfg.get("threads"):
        torch.set_num_threads(cfg["threads"])
    L.seed_everything(0, verbose=False)
    model = TinyGPT(n_layers=4)
    train, val = loader(32, 8), loader(24, 8, seed=1)
    trainer = L.Trainer(
        accelerator="cpu",
        devices=cfg.get("devices", 1),
        strategy=lightning_pp.PipelineStrategy(schedule="gpipe", layers="net.blocks")
        if cfg.get("pipeline")
        else "auto",
        max_epochs=1,
        logger=False,
        enable_checkpointing=False,
        enable_progress_bar=False,
        enable_model_summary=False,
    )
    seen: dict[str, Any] = {}
    seen["validate_first"] = trainer.validate(model, val, verbose=False)[0]["val_loss"]
    seen["test_first"] = trainer.test(model, val, verbose=False)[0]["test_loss"]
    trainer.fit(model, train, val)
    seen["fit_val"] = float(trainer.callback_metrics["val_loss"])
    seen["test_after"] = trainer.test(model, val, verbose=False)[0]["test_loss"]
    seen["validate_after"] = trainer.validate(model, val, verbose=False)[0]["val_loss"]
    try:
        model(torch.zeros(2, 8, dtype=torch.long))
        seen["call"] = "ok"
    except RuntimeError as error:
        seen["call"] = str(error)
    seen["threads"] = torch.get_num_threads()
    (out / f"rank{trainer.global_rank}.json").write_text(json.dumps(seen))
    return seen


if __name__ == "__main__":
    run(json.loads(sys.argv[1]))
