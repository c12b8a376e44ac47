"""Fine-tune a pretrained Hugging Face model with LoRA adapters as a 2-rank pipeline built on meta, then export
the adapters for peft and the merged model for transformers (needs `pip install transformers peft`; no download:
the "pretrained" model is made and saved here first).

python examples/finetune_lora.py    # 2 CPU processes; writes pretrained/, lora.ckpt, adapter/ and merged/
"""

from pathlib import Path

import lightning as L
import torch
from peft import LoraConfig, PeftModel, get_peft_model
from torch.utils.data import DataLoader, TensorDataset
from transformers import AutoModelForCausalLM, LlamaConfig, LlamaForCausalLM

from lightning_pp import PipelineStrategy
from lightning_pp.consolidate import export_hf, export_peft


class LoraLlama(L.LightningModule):
    def __init__(self, config: LlamaConfig):
        super().__init__()
        lora = LoraConfig(r=8, lora_alpha=16, target_modules=["q_proj", "v_proj"])
        self.model = get_peft_model(LlamaForCausalLM(config), lora)  # under init_module(): on meta, nothing allocated

    def training_step(self, batch, batch_idx):
        (tokens,) = batch
        loss = self.model(input_ids=tokens, labels=tokens).loss  # served on the last stage
        self.log("train_loss", loss, prog_bar=True)
        return loss

    def configure_optimizers(self):
        return torch.optim.AdamW([p for p in self.parameters() if p.requires_grad], lr=3e-3)


if __name__ == "__main__":
    config = LlamaConfig(
        vocab_size=64, hidden_size=64, intermediate_size=128, num_hidden_layers=4, num_attention_heads=4,
        num_key_value_heads=2, max_position_embeddings=32, use_cache=False,
    )  # fmt: skip
    pretrained = Path("pretrained")
    if not pretrained.exists():  # stands in for a downloaded model; rank 1 re-runs this script and finds it
        LlamaForCausalLM(config).save_pretrained(pretrained, max_shard_size="100KB")
    L.seed_everything(0)
    tokens = (torch.arange(32) * torch.randint(1, 4, (256, 1)) + torch.randint(0, 64, (256, 1))) % 64
    strategy = PipelineStrategy(schedule="zbv", split="trace", layers="model.model.layers", init_weights=pretrained)
    trainer = L.Trainer(accelerator="cpu", devices=2, strategy=strategy, max_steps=8, logger=False,
                        enable_checkpointing=False, enable_progress_bar=False)  # fmt: skip
    with trainer.init_module(empty_init=True):
        model = LoraLlama(config)  # each rank reads its base tensors; lora_B starts at zero, as peft starts it
    trainer.fit(model, DataLoader(TensorDataset(tokens), batch_size=16))
    trainer.save_checkpoint("lora.ckpt")  # the adapters and their optimizer state: the base stays in pretrained/
    if trainer.is_global_zero:
        # as python -m lightning_pp.consolidate lora.ckpt adapter --format peft (and merged --format hf)
        export_peft(Path("lora.ckpt"), Path("adapter"))  # the adapter alone, for peft
        export_hf(Path("lora.ckpt"), Path("merged"))  # the base with the adapters folded in, for transformers
        adapted = PeftModel.from_pretrained(AutoModelForCausalLM.from_pretrained(pretrained), "adapter")
        merged = AutoModelForCausalLM.from_pretrained("merged")
        with torch.no_grad():
            differ = (adapted(input_ids=tokens[:4]).logits - merged(input_ids=tokens[:4]).logits).abs().max()
        print(f"adapter/ on pretrained/ and merged/ agree to {differ:.1e}; lora.ckpt is"
              f" {Path('lora.ckpt').stat().st_size / 1024:.0f} KiB")  # fmt: skip
