"""A Hugging Face causal language model from a config (no download), trained unchanged with
``PipelineStrategy(split="trace", layers="model.transformer.h")`` (GPT-2; ``model.layers`` for most others).

Needs ``pip install transformers``. The model is whatever ``AutoModelForCausalLM.from_config`` builds: a
forward that skips no part, a tied embedding and head, the loss computed inside the model.
"""

from __future__ import annotations

from typing import Any

import lightning as L
import torch


class HFCausalLM(L.LightningModule):
    """``config`` are the family's config keys (``hidden_size``, ``num_attention_heads``, ``vocab_size``, ...);
    ``peft`` a peft config (``peft.LoraConfig(...)``, the app's ``peft=lora``): the model is wrapped by
    ``peft.get_peft_model``, so only the adapters train."""

    def __init__(
        self, model_type: str = "gpt2", n_layers: int = 4, lr: float = 3e-3, peft: Any = None, **config: Any
    ) -> None:
        super().__init__()
        from transformers import AutoConfig, AutoModelForCausalLM

        self.save_hyperparameters(ignore="peft")  # a peft config object: not for hparams.yaml (Hydra's config has it)
        hf_config = AutoConfig.for_model(model_type, num_hidden_layers=n_layers, use_cache=False, **config)
        # built on meta (trainer.init_module, the Hydra app), each rank initialises its stage as transformers
        # and peft would: the model's _init_weights, each LoRA layer's reset_lora_parameters
        self.model = AutoModelForCausalLM.from_config(hf_config)
        if peft is not None:  # the layers then sit at model.base_model.model.<the model's own path>
            from peft import get_peft_model

            self.model = get_peft_model(self.model, peft)

    def _loss(self, batch: tuple[torch.Tensor, torch.Tensor]) -> torch.Tensor:
        tokens, _ = batch
        return self.model(input_ids=tokens, labels=tokens).loss  # HF shifts the labels itself

    def training_step(self, batch, batch_idx):
        loss = self._loss(batch)
        self.log("train_loss", loss, prog_bar=True)
        return loss

    def validation_step(self, batch, batch_idx):
        self.log("val_loss", self._loss(batch), prog_bar=True)

    def configure_optimizers(self) -> torch.optim.Optimizer:
        return torch.optim.AdamW(self.parameters(), lr=self.hparams.lr)
