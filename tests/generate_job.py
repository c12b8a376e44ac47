"""Generation through the pipeline against one process: ``python tests/generate_job.py '<json>'`` on every rank
(``conftest.run_script(..., ranks=N)``), or ``run(cfg)`` in the test's own process for the one-process reference.

Each case trains a small causal LM in float64 (the pipeline's weights then equal one process's to the last
bits that a float32 sample could tell apart) for ``steps`` steps; after step ``at`` a callback generates on every rank
(greedy with an EOS, then sampled with a seed), and training goes on. Every rank writes ``{case}.rank{r}.json``:
the losses, what it generated, its caches' bytes.
"""

from __future__ import annotations

import json
import os
import sys
from pathlib import Path
from typing import Any

import lightning as L
import torch
import torch.nn.functional as F
from torch import nn
from torch.utils.data import DataLoader, DistributedSampler

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

from lightning_pp import GenerateSamples, PipelineStrategy  # noqa: E402

VOCAB, ROWS, LENGTH = 48, 4, 8


def prompts(replica: int = 0) -> tuple[torch.Tensor, torch.Tensor]:
    """Five prompts of three lengths, left-padded (pad id 0); each replica its own."""
    g = torch.Generator().manual_seed(7 + replica)
    lengths = [6, 3, 6, 1, 4]
    ids = torch.zeros(len(lengths), 6, dtype=torch.long)
    mask = torch.zeros_like(ids)
    for row, n in enumerate(lengths):
        ids[row, 6 - n :] = torch.randint(1, VOCAB, (n,), generator=g)
        mask[row, 6 - n :] = 1
    return ids, mask


class _CausalLM(L.LightningModule):
    def training_step(self, batch, batch_idx):
        loss = self._loss(batch)
        self.log("train_loss", loss, sync_dist=True)  # replicas: the mean over their batches
        return loss

    def configure_optimizers(self):
        return torch.optim.SGD(self.parameters(), lr=0.05)

    def validation_step(self, batch, batch_idx):
        self.log("val_loss", self._loss(batch), sync_dist=True)

    def predict_step(self, batch, batch_idx):
        """Through the pipeline ``strategy.generate``; on one process the reference."""
        ids, mask = batch["input_ids"], batch["attention_mask"]
        if isinstance(self.trainer.strategy, PipelineStrategy):
            return self.trainer.strategy.generate(ids, mask, max_new_tokens=4)
        return self.reference_generate(ids, mask, max_new_tokens=4)


class HFModel(_CausalLM):
    """A Hugging Face causal LM from a small config."""

    def __init__(self, kind: str) -> None:
        super().__init__()
        import transformers as tf

        common = dict(vocab_size=VOCAB, num_hidden_layers=4, use_cache=False)
        if kind == "gpt2":
            config = tf.GPT2Config(
                n_embd=32, n_head=4, n_positions=64, resid_pdrop=0, embd_pdrop=0, attn_pdrop=0, **common
            )  # tied: wte is lm_head
        elif kind == "qwen3moe":
            config = tf.Qwen3MoeConfig(
                hidden_size=32, intermediate_size=64, moe_intermediate_size=16, num_experts=4, num_experts_per_tok=2,
                num_attention_heads=4, num_key_value_heads=2, head_dim=8, max_position_embeddings=64, **common,
            )  # fmt: skip
        else:
            config = tf.LlamaConfig(
                hidden_size=32, intermediate_size=64, num_attention_heads=4, num_key_value_heads=2,
                max_position_embeddings=64, **common,
            )  # fmt: skip
        self.model = tf.AutoModelForCausalLM.from_config(config)

    def _loss(self, batch):
        return self.model(input_ids=batch, labels=batch).loss

    def reference_generate(self, ids, mask, **sampling):
        top_k = sampling.pop("top_k", None)
        return self.model.generate(
            ids, attention_mask=mask, use_cache=True, top_k=top_k or 0, **{"pad_token_id": 0, **sampling}
        )


class Block(nn.Module):
    """A pre-norm attention block that keeps its keys and values in a Hugging Face cache."""

    def __init__(self, index: int, width: int = 32, heads: int = 4) -> None:
        super().__init__()
        self.index, self.heads = index, heads
        self.norm1, self.norm2 = nn.LayerNorm(width), nn.LayerNorm(width)
        self.qkv, self.proj = nn.Linear(width, 3 * width), nn.Linear(width, width)
        self.mlp = nn.Sequential(nn.Linear(width, 4 * width), nn.GELU(), nn.Linear(4 * width, width))

    def forward(self, x, keep=None, past_key_values=None):
        b, t, w = x.shape
        q, k, v = self.qkv(self.norm1(x)).view(b, t, 3, self.heads, w // self.heads).permute(2, 0, 3, 1, 4)
        if past_key_values is not None:
            k, v = past_key_values.update(k, v, self.index)
        attn = F.scaled_dot_product_attention(q, k, v, attn_mask=keep)
        x = x + self.proj(attn.transpose(1, 2).reshape(b, t, w))
        return x + self.mlp(self.norm2(x))


class NoCacheBlock(Block):
    def forward(self, x, keep=None):
        return super().forward(x, keep)


class SeedGPT(_CausalLM):
    """The seed convention: parts another stage holds are None and skipped; a cache passed to every layer."""

    def __init__(self, block: type = Block) -> None:
        super().__init__()
        self.embed, self.pos = nn.Embedding(VOCAB, 32), nn.Embedding(64, 32)
        self.layers = nn.ModuleList(block(i) for i in range(4))
        self.norm, self.head = nn.LayerNorm(32), nn.Linear(32, VOCAB)

    def forward(self, input_ids, attention_mask=None, position_ids=None, past_key_values=None, use_cache=False):
        b, t = input_ids.shape[:2]
        past = past_key_values.get_seq_length() if past_key_values is not None else 0
        if position_ids is None:
            position_ids = torch.arange(past, past + t, device=input_ids.device).expand(b, t)
        keys = past + t
        keep = torch.ones(t, keys, dtype=torch.bool, device=input_ids.device).tril(past)[None, None]
        if attention_mask is not None:
            keep = keep & attention_mask[:, None, None, :keys].bool()
        x = self.embed(input_ids) + self.pos(position_ids) if self.embed is not None else input_ids
        for layer in self.layers:
            x = layer(x, keep, past_key_values) if past_key_values is not None else layer(x, keep)
        return self.head(self.norm(x)) if self.head is not None else x

    def _loss(self, batch):
        return F.cross_entropy(self(batch[:, :-1]).flatten(0, 1), batch[:, 1:].flatten())

    @torch.no_grad()
    def reference_generate(
        self, ids, mask, max_new_tokens, do_sample=False, eos_token_id=None, pad_token_id=0, **sampling
    ):
        """The whole sequence again each step (no cache), as a plain loop on one process would."""
        going = torch.ones(ids.shape[0], dtype=torch.bool)
        for _ in range(max_new_tokens):
            positions = (mask.cumsum(-1) - 1).masked_fill(mask == 0, 0)
            logits = self(ids, attention_mask=mask, position_ids=positions)[:, -1].float()
            if do_sample:
                logits = logits / sampling.get("temperature", 1.0)
                if sampling.get("top_k"):
                    logits = logits.masked_fill(logits < logits.topk(sampling["top_k"])[0][:, -1:], -float("inf"))
                tokens = torch.multinomial(torch.softmax(logits, -1), 1)[:, 0]
            else:
                tokens = logits.argmax(-1)
            if eos_token_id is not None:
                tokens = torch.where(going, tokens, torch.full_like(tokens, pad_token_id))
                going &= tokens != eos_token_id
            ids, mask = torch.cat([ids, tokens[:, None]], 1), torch.cat([mask, torch.ones_like(mask[:, :1])], 1)
            if eos_token_id is not None and not going.any():
                break
        return ids


def build(model: str) -> _CausalLM:
    torch.manual_seed(1 if model.endswith("_other") else 0)
    model = model.removesuffix("_other")
    if model == "seed":
        return SeedGPT()
    if model == "nocache":
        return SeedGPT(NoCacheBlock)
    return HFModel(model)


def data(replicas: int, replica: int | None) -> DataLoader:
    """Each replica's batch of ``ROWS`` (replica r: rows r, r + replicas, ... in order); one process (``replica``
    None) takes the replicas' batches together."""
    g = torch.Generator().manual_seed(1)
    rows = torch.randint(1, VOCAB, (16 * replicas, LENGTH), generator=g)
    if replica is None:
        return DataLoader(rows, batch_size=ROWS * replicas)
    return DataLoader(rows, batch_size=ROWS, sampler=DistributedSampler(rows, replicas, replica, shuffle=False))


class Generate(L.Callback):
    """Generates after training step ``at`` on every rank, the way the case asks."""

    def __init__(self, case: dict[str, Any], pipelined: bool) -> None:
        self.case, self.pipelined = case, pipelined
        self.results: dict[str, Any] = {}

    def on_train_batch_end(self, trainer, module, outputs, batch, batch_idx):
        if trainer.global_step != self.case.get("at", 2):
            return
        if self.pipelined:
            self.generate(trainer, module, trainer.strategy.layout.replica, "")
        else:
            for replica in range(self.case.get("replicas", 1)):
                self.generate(trainer, module, replica, f"{replica}/" if replica else "")

    def generate(self, trainer, module, replica: int, prefix: str) -> None:
        ids, mask = (t.to(module.device) for t in prompts(replica))
        for kind, sampling in runs(self.case).items():
            name = prefix + kind
            if kind == "greedy_eos":  # a token a row makes second or third, not before: it ends mid-way
                rows = [row[ids.shape[1] :] for row in self.results[prefix + "greedy"]]
                ends = [row[i] for row in rows for i in (1, 2, 3) if row[i] not in row[:i]]
                sampling["eos_token_id"] = (ends or [rows[1][0]])[0]
            try:
                if self.pipelined:
                    out = trainer.strategy.generate(ids, mask, **sampling)
                    self.results[f"{name}_cache_bytes"] = trainer.strategy.last_generation.cache_bytes
                else:  # generate runs the model in eval mode (no dropout)
                    torch.manual_seed(sampling.get("seed", 0))
                    module.eval()
                    out = module.reference_generate(ids, mask, **{k: v for k, v in sampling.items() if k != "seed"})
                    module.train()
                self.results[name] = out.tolist()
            except Exception as error:  # noqa: BLE001 (the test reads the refusal)
                self.results[name] = f"{type(error).__name__}: {error}"
                if os.environ.get("GENERATE_JOB_RAISE"):
                    raise
                return


def runs(case: dict[str, Any]) -> dict[str, dict[str, Any]]:
    """What each case generates: greedy with an EOS that one row meets mid-way (found by the reference), and
    sampled with a seed."""
    return {
        "greedy": {"max_new_tokens": 6},
        "greedy_eos": {"max_new_tokens": 6, "pad_token_id": 0},
        "sampled": {"max_new_tokens": 5, "do_sample": True, "temperature": 0.8, "top_k": 20, "seed": 3},
    }


def run(cfg: dict[str, Any]) -> dict[str, Any]:
    torch.set_num_threads(cfg.get("threads", 1))
    pipelined = cfg.get("pipelined", True)
    out = Path(cfg["out"])
    out.mkdir(parents=True, exist_ok=True)
    results = {}
    for case in cfg["cases"]:
        model = build(case["model"])
        callback = Generate(case, pipelined)
        keys = ("schedule", "split", "stages_per_rank", "data_parallel", "pipeline_parallel_size", "n_microbatches")
        options = {"n_microbatches": 2, **{k: case[k] for k in keys if k in case}}
        strategy = PipelineStrategy(**options) if pipelined else "auto"
        callbacks: list[L.Callback] = [callback]
        logger: Any = False
        if case.get("samples") and pipelined:  # the first two prompts, as GenerateSamples pads them
            ids, mask = prompts()
            unpadded = [row[m.bool()].tolist() for row, m in zip(ids[:2], mask[:2])]
            callbacks.append(GenerateSamples(unpadded, max_new_tokens=4))
            name = case.get("name", case["model"])
            logger = [L.pytorch.loggers.CSVLogger(out, name=name, version=0),
                      L.pytorch.loggers.TensorBoardLogger(out / "tb", name=name, version=0)]  # fmt: skip
        devices = cfg.get("ranks", 1) if pipelined else 1
        trainer = L.Trainer(
            strategy=strategy, accelerator=cfg.get("accelerator", "cpu"), devices=devices,
            max_steps=case.get("steps", 3), logger=logger, enable_checkpointing=False, enable_progress_bar=False,
            enable_model_summary=False, callbacks=callbacks, num_sanity_val_steps=0, val_check_interval=2,
            limit_val_batches=case.get("val_batches", 1),
            precision=case.get("precision", "64-true"), use_distributed_sampler=False,
        )  # fmt: skip
        replicas = case.get("replicas", 1)
        replica = int(os.environ.get("RANK", 0)) * replicas // cfg.get("ranks", 1) if pipelined else None
        loader = data(replicas, replica)
        trainer.fit(model, loader, loader)
        name = case.get("name", case["model"])
        result = {**callback.results, "loss": float(trainer.callback_metrics["train_loss"])}
        if case.get("predict"):
            ids, mask = prompts()
            # the first batch splits into the strategy's micro-batches (a fresh predict builds the stages from it)
            batches = [{"input_ids": ids[i:j], "attention_mask": mask[i:j]} for i, j in ((0, 4), (4, 5))]
            predicted = trainer.predict(model, DataLoader(batches, batch_size=None))
            result["predicted"] = None if predicted is None else [row.tolist() for row in predicted]
            if pipelined:  # a fresh Trainer and module: predict builds the stages, reading the checkpoint
                trainer.save_checkpoint(out / f"{name}.ckpt")
                fresh = L.Trainer(
                    strategy=PipelineStrategy(**options), accelerator=cfg.get("accelerator", "cpu"),
                    devices=cfg["ranks"], logger=False,
                    precision=case.get("precision", "64-true"), enable_progress_bar=False, enable_model_summary=False,
                )  # fmt: skip
                again = fresh.predict(build(case["model"] + "_other"), DataLoader(batches, batch_size=None),
                                      ckpt_path=out / f"{name}.ckpt")  # fmt: skip
                result["predicted_from_checkpoint"] = None if again is None else [row.tolist() for row in again]
        results[name] = result
        if pipelined:
            replica = trainer.strategy.layout.replica
            result = {f"{replica}/{k}" if replica and k != "loss" else k: v for k, v in result.items()}
            (out / f"{name}.rank{trainer.global_rank}.json").write_text(json.dumps(result))
    return results


if __name__ == "__main__":
    run(json.loads(sys.argv[1]))
