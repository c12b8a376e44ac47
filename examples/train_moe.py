"""A Qwen3-MoE causal LM (tiny config, no download) trained as transformers builds it, with its load-balancing
loss, on 4 CPU processes: 2 pipeline stages x 2 replicas, each replica rank holding half of every layer's experts.

    python examples/train_moe.py
"""

import lightning as L
import torch
from transformers import Qwen3MoeConfig, Qwen3MoeForCausalLM

from lightning_pp import PipelineStrategy


class MoE(L.LightningModule):
    def __init__(self):
        super().__init__()
        config = Qwen3MoeConfig(
            vocab_size=64, hidden_size=64, intermediate_size=128, moe_intermediate_size=32, num_hidden_layers=4,
            num_attention_heads=4, num_key_value_heads=2, head_dim=16, num_experts=8, num_experts_per_tok=2,
            output_router_logits=True, router_aux_loss_coef=0.01, bos_token_id=0, eos_token_id=0, use_cache=False,
        )  # fmt: skip
        self.model = Qwen3MoeForCausalLM(config)  # transformers' defaults: grouped_mm experts

    def training_step(self, batch, batch_idx):
        (tokens,) = batch
        out = self.model(input_ids=tokens, labels=tokens)  # .loss includes 0.01 x .aux_loss
        chosen = out.router_logits[-1].topk(2, dim=-1).indices  # the last layer's routing of these tokens
        self.log("train_loss", out.loss, prog_bar=True)
        self.log("aux_loss", out.aux_loss)
        self.log("expert0_share", (chosen == 0).float().mean())
        return out.loss

    def configure_optimizers(self):
        return torch.optim.AdamW(self.parameters(), lr=3e-3)


if __name__ == "__main__":
    L.seed_everything(0)
    tokens = (torch.arange(16) * torch.randint(1, 4, (256, 1)) + torch.randint(0, 64, (256, 1))) % 64
    loader = torch.utils.data.DataLoader(torch.utils.data.TensorDataset(tokens), batch_size=8)
    strategy = PipelineStrategy(split="trace", layers="model.model.layers", pipeline_parallel_size=2,
                                expert_parallel_size=2, n_microbatches=2)  # fmt: skip
    trainer = L.Trainer(accelerator="cpu", devices=4, strategy=strategy, max_steps=4, enable_model_summary=False,
                        enable_progress_bar=False, logger=False, enable_checkpointing=False)  # fmt: skip
    trainer.fit(MoE(), loader)
    held = sum(p.to_local().numel() for n, p in trainer.model.named_parameters() if ".experts." in n)
    print(f"rank {trainer.global_rank}: {held} expert parameters held, {trainer.callback_metrics}")
