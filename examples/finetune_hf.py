"""Fine-tune a pretrained Hugging Face model as a 2-stage pipeline whose ranks read only their own tensors,
then export the result back to Hugging Face's format (needs `pip install transformers`; no download: the
"pretrained" model is made and saved here first).

python examples/finetune_hf.py    # 2 CPU processes; writes pretrained/, finetuned/ and finetuned-hf/
"""

from pathlib import Path

import lightning as L
import torch
from torch.utils.data import DataLoader, TensorDataset
from transformers import AutoModelForCausalLM, LlamaConfig, LlamaForCausalLM

from lightning_pp import PipelineStrategy
from lightning_pp.consolidate import export_hf


class Llama(L.LightningModule):
    def __init__(self, config: LlamaConfig):
        super().__init__()
        self.model = LlamaForCausalLM(config)  # under trainer.init_module(): on meta, no memory, no init

    def training_step(self, batch, batch_idx):
        (tokens,) = batch
        loss = self.model(input_ids=tokens, labels=tokens).loss  # served on the last stage
        self.log("train_loss", loss, prog_bar=True)
        return loss

    def configure_optimizers(self):
        return torch.optim.AdamW(self.parameters(), lr=1e-3)


if __name__ == "__main__":
    config = LlamaConfig(
        vocab_size=64, hidden_size=64, intermediate_size=128, num_hidden_layers=4, num_attention_heads=4,
        num_key_value_heads=2, max_position_embeddings=32, use_cache=False,
    )  # fmt: skip
    pretrained = Path("pretrained")
    if not pretrained.exists():  # stands in for a downloaded model; rank 1 re-runs this script and finds it
        LlamaForCausalLM(config).save_pretrained(pretrained, max_shard_size="100KB")  # several shards
    L.seed_everything(0)
    tokens = (torch.arange(32) * torch.randint(1, 4, (256, 1)) + torch.randint(0, 64, (256, 1))) % 64
    strategy = PipelineStrategy(
        split="trace", layers="model.model.layers", init_weights=pretrained, state_dict_type="sharded"
    )
    trainer = L.Trainer(accelerator="cpu", devices=2, strategy=strategy, max_steps=8, logger=False,
                        enable_checkpointing=False, enable_progress_bar=False)  # fmt: skip
    with trainer.init_module(empty_init=True):
        model = Llama(config)
    trainer.fit(model, DataLoader(TensorDataset(tokens), batch_size=16))
    trainer.save_checkpoint("finetuned")  # a directory: every rank writes its own stage
    if trainer.is_global_zero:
        # as python -m lightning_pp.consolidate finetuned finetuned-hf --format hf, without a new process
        export_hf(Path("finetuned"), Path("finetuned-hf"))
        finetuned = AutoModelForCausalLM.from_pretrained("finetuned-hf")
        print(f"finetuned-hf: {sum(p.numel() for p in finetuned.parameters())} parameters, as HF loads them")
