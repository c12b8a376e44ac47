"""One rank of a generation benchmark: an HF Llama (weights from a seed, no download) generating greedily through
the pipeline (``strategy.generate`` after a one-step fit at learning rate 0 that builds the stages), or
Hugging Face's ``generate`` on one process. Per batch size: the timed call's seconds (after a warm-up call) and,
through the pipeline, each rank's cache bytes at the end; rank 0 writes the JSON, with the tokens.

    torchrun --nproc_per_node P run_generate.py pipeline SHAPE PROMPT NEW OUT
    python run_generate.py single SHAPE PROMPT NEW OUT THREADS
"""

from __future__ import annotations

import json
import os
import sys
import time

import lightning as L
import torch
import torch.distributed as dist
from torch.utils.data import DataLoader

from lightning_pp import PipelineStrategy

BATCHES = (1, 8)
SHAPES = {
    "llama-30M": dict(hidden_size=512, intermediate_size=1376, num_hidden_layers=8, num_attention_heads=8,
                      num_key_value_heads=4, vocab_size=8192),
    "llama-120M": dict(hidden_size=1024, intermediate_size=2816, num_hidden_layers=8, num_attention_heads=16,
                       num_key_value_heads=8, vocab_size=8192),
}  # fmt: skip


class Llama(L.LightningModule):
    def __init__(self, shape: str) -> None:
        super().__init__()
        from transformers import LlamaConfig, LlamaForCausalLM

        torch.manual_seed(0)
        self.model = LlamaForCausalLM(LlamaConfig(**SHAPES[shape], max_position_embeddings=512, use_cache=False))

    def training_step(self, batch, batch_idx):
        return self.model(input_ids=batch, labels=batch).loss

    def configure_optimizers(self):
        return torch.optim.SGD(self.parameters(), lr=0.0)  # the stages are built, the weights stay the seed's


def prompts(rows: int, length: int, vocab: int) -> torch.Tensor:
    return torch.randint(1, vocab, (rows, length), generator=torch.Generator().manual_seed(rows))


def main() -> None:
    mode, shape, length, new, out = sys.argv[1], sys.argv[2], int(sys.argv[3]), int(sys.argv[4]), sys.argv[5]
    vocab = SHAPES[shape]["vocab_size"]
    model = Llama(shape)
    results: dict[str, dict] = {}
    if mode == "single":
        torch.set_num_threads(int(sys.argv[6]))
        model.eval()
        for rows in BATCHES:
            ids = prompts(rows, length, vocab)
            with torch.no_grad():
                model.model.generate(ids, max_new_tokens=2, do_sample=False, use_cache=True)  # warm-up
                start = time.perf_counter()
                tokens = model.model.generate(ids, max_new_tokens=new, do_sample=False, use_cache=True)
            results[str(rows)] = {"seconds": time.perf_counter() - start, "tokens": tokens[:, length:].tolist()}
        with open(out, "w") as f:
            json.dump({"batches": results}, f)
        return
    trainer = L.Trainer(
        strategy=PipelineStrategy(n_microbatches=1, schedule="gpipe"), accelerator="cpu", max_steps=1,
        devices=int(os.environ["WORLD_SIZE"]),
        logger=False, enable_checkpointing=False, enable_progress_bar=False, enable_model_summary=False,
    )  # fmt: skip
    trainer.fit(model, DataLoader(prompts(2, 16, vocab), batch_size=2))
    strategy = trainer.strategy
    for rows in BATCHES:
        ids = prompts(rows, length, vocab)
        strategy.generate(ids, max_new_tokens=2)  # warm-up
        dist.barrier()
        start = time.perf_counter()
        tokens = strategy.generate(ids, max_new_tokens=new)
        seconds = time.perf_counter() - start
        caches: list = [None] * dist.get_world_size()
        dist.all_gather_object(caches, sum(strategy.last_generation.cache_bytes.values()))
        results[str(rows)] = {"seconds": seconds, "tokens": tokens[:, length:].tolist(), "cache_bytes": caches}
    if trainer.global_rank == 0:
        with open(out, "w") as f:
            json.dump({"batches": results}, f)


if __name__ == "__main__":
    main()
