"""HF GPT-2, unchanged, as a 2-stage pipeline split by torch's tracer (needs `pip install transformers`).

python examples/train_hf_gpt2.py    # 2 CPU processes; the loss falls from ln 64 = 4.16 to about 1.0
"""

import lightning as L
import torch
from transformers import GPT2Config, GPT2LMHeadModel

from lightning_pp import PipelineStrategy


class GPT2(L.LightningModule):
    def __init__(self):
        super().__init__()
        config = GPT2Config(
            vocab_size=64,
            n_positions=32,
            n_embd=64,
            n_layer=4,
            n_head=4,
            use_cache=False,
            bos_token_id=0,
            eos_token_id=0,
        )
        self.model = GPT2LMHeadModel(config)  # unchanged: ModuleList blocks, tied wte/lm_head, loss inside

    def training_step(self, batch, batch_idx):
        (tokens,) = batch
        loss = self.model(input_ids=tokens, labels=tokens).loss  # served on the last stage
        self.log("train_loss", loss, prog_bar=True)
        return loss

    def configure_optimizers(self):
        return torch.optim.AdamW(self.parameters(), lr=3e-3)


if __name__ == "__main__":
    L.seed_everything(0)
    tokens = (torch.arange(32) * torch.randint(1, 4, (512, 1)) + torch.randint(0, 64, (512, 1))) % 64
    loader = torch.utils.data.DataLoader(torch.utils.data.TensorDataset(tokens), batch_size=16)
    strategy = PipelineStrategy(split="trace", layers="model.transformer.h")
    trainer = L.Trainer(accelerator="cpu", devices=2, strategy=strategy, max_epochs=2, enable_model_summary=False)
    trainer.fit(GPT2(), loader)
