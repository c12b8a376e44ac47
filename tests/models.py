"""LightningModules for the tests, in shapes the example does not have.

``TinyGPT`` keeps its layers at a dotted path (``net.blocks``), takes dict batches, has a loose
position Parameter used before the layers and a loss module forward never calls.
"""

from __future__ import annotations

import lightning as L
import torch
import torch.nn.functional as F
import torchmetrics
from torch import nn
from torch.utils.data import DataLoader, Dataset

from lightning_pp.examples.mlp import ResidualBlock


class Net(nn.Module):
    def __init__(self, vocab: int, dim: int, n_layers: int, seq: int) -> None:
        super().__init__()
        self.embed = nn.Embedding(vocab, dim)
        self.pos = nn.Parameter(torch.randn(seq, dim) * 0.1)
        self.blocks = nn.ModuleDict({f"b{i}": ResidualBlock(dim) for i in range(n_layers)})
        self.head = nn.Linear(dim, vocab)


class InitNet(Net):
    """``Net`` with an initialiser for the loose position table it owns, as a module built on meta needs."""

    def reset_parameters(self) -> None:
        nn.init.normal_(self.pos, std=0.1)


class TinyGPT(L.LightningModule):
    def __init__(
        self,
        vocab: int = 32,
        dim: int = 32,
        n_layers: int = 4,
        seq: int = 8,
        lr: float = 1e-2,
        optimizer: str = "adamw",
        sync_dist: bool = False,
        plateau: bool = False,
        metrics: bool = False,
        late: bool = False,
    ) -> None:
        super().__init__()
        self.save_hyperparameters()
        # late: the network is built in configure_model, Lightning's hook for models larger than one device
        self.net = None if late else self.make_net()
        self.final_norm = nn.LayerNorm(dim)
        self.criterion = nn.CrossEntropyLoss()
        if metrics:
            self.train_acc = torchmetrics.classification.MulticlassAccuracy(vocab, average="micro")
            self.val_acc = torchmetrics.classification.MulticlassAccuracy(vocab, average="micro")
            self.val_f1 = torchmetrics.classification.MulticlassF1Score(vocab, average="macro")

    def make_net(self) -> Net:
        return Net(self.hparams.vocab, self.hparams.dim, self.hparams.n_layers, self.hparams.seq)

    def configure_model(self) -> None:
        if self.net is None:
            self.net = self.make_net()

    def forward(self, tokens: torch.Tensor) -> torch.Tensor:
        h = tokens
        if self.net.embed is not None:
            h = self.net.embed(tokens) + self.net.pos[: tokens.shape[1]]
        for block in self.net.blocks.values():
            h = block(h)
        if self.final_norm is not None:
            h = self.final_norm(h)
        return self.net.head(h) if self.net.head is not None else h

    def _loss(self, batch: dict) -> torch.Tensor:
        logits = self(batch["tokens"])
        return self.criterion(logits.flatten(0, 1), batch["targets"].flatten())

    def training_step(self, batch, batch_idx):
        logits = self(batch["tokens"])
        loss = self.criterion(logits.flatten(0, 1), batch["targets"].flatten())
        self.loss_steps = getattr(self, "loss_steps", 0) + 1  # only where the model call returned: the last stage
        self.log("train_loss", loss, prog_bar=True, sync_dist=self.hparams.sync_dist)
        self.log("train_max", loss, reduce_fx="max", on_step=True, on_epoch=False)
        if self.hparams.metrics:
            self.train_acc(logits.flatten(0, 1), batch["targets"].flatten())
            self.log("train_acc", self.train_acc, on_step=True, on_epoch=True)
        return {"loss": loss}

    def validation_step(self, batch, batch_idx):
        logits = self(batch["tokens"])
        self.log("val_loss", self.criterion(logits.flatten(0, 1), batch["targets"].flatten()),
                 sync_dist=self.hparams.sync_dist)  # fmt: skip
        if self.hparams.metrics:
            self.val_acc.update(logits.flatten(0, 1), batch["targets"].flatten())
            self.val_f1.update(logits.flatten(0, 1), batch["targets"].flatten())
            self.log("val_acc", self.val_acc)

    def on_validation_epoch_end(self):
        if self.hparams.metrics:
            # a non-step hook on every rank: works because every rank holds the mirrored state
            self.log("val_f1", self.val_f1.compute())
            self.val_f1.reset()

    def test_step(self, batch, batch_idx):
        self.log("test_loss", self._loss(batch))

    def predict_step(self, batch, batch_idx):
        logits = self(batch["tokens"])
        return {"probs": logits.softmax(-1), "tokens": logits.argmax(-1), "batch_idx": batch_idx}

    def configure_optimizers(self):
        if self.hparams.optimizer in ("sgd", "plain_sgd"):
            momentum = 0.9 if self.hparams.optimizer == "sgd" else 0.0
            return torch.optim.SGD(self.parameters(), lr=self.hparams.lr, momentum=momentum)
        decay = [p for n, p in self.named_parameters() if p.dim() >= 2]
        no_decay = [p for n, p in self.named_parameters() if p.dim() < 2]
        optimizer = torch.optim.AdamW(
            [{"params": decay, "weight_decay": 0.1}, {"params": no_decay, "weight_decay": 0.0}],
            lr=self.hparams.lr,
            fused=self.hparams.optimizer == "fused_adamw",
        )
        if not self.hparams.plateau:
            return optimizer
        # a scheduler that monitors a logged metric: needs the value on every rank
        plateau = torch.optim.lr_scheduler.ReduceLROnPlateau(optimizer, factor=0.5, patience=0, threshold=0.5)
        return {
            "optimizer": optimizer,
            "lr_scheduler": {"scheduler": plateau, "monitor": "train_loss", "interval": "step"},
        }


class Tokens(Dataset):
    """Random sequences whose targets are a fixed function of the tokens (learnable, no download)."""

    def __init__(self, n: int, seq: int = 8, vocab: int = 32, seed: int = 0, pad: bool = False) -> None:
        g = torch.Generator().manual_seed(seed)
        self.tokens = torch.randint(0, vocab, (n, seq), generator=g)
        self.targets = (self.tokens * 7 + 3) % vocab
        if pad:  # padded sequences: targets -100 past a random length of at least 2 (one label after the shift)
            lengths = torch.randint(2, seq + 1, (n, 1), generator=g)
            self.targets[torch.arange(seq).expand(n, seq) >= lengths] = -100

    def __len__(self) -> int:
        return len(self.tokens)

    def __getitem__(self, i: int) -> dict:
        return {"tokens": self.tokens[i], "targets": self.targets[i]}


def loader(
    n: int,
    batch_size: int,
    seed: int = 0,
    seq: int = 8,
    vocab: int = 32,
    pad: bool = False,
    vary: bool = False,
    encoded: bool = False,
) -> DataLoader:
    """``vary``: each batch cut to its own sequence length (3 to ``seq``), as dynamic padding pads to the longest;
    ``encoded``: each batch a Hugging Face ``BatchEncoding``, as its data collators return."""
    collate = _cut_to_a_length_of_its_own if vary else _encoded if encoded else None
    return DataLoader(Tokens(n, seq, vocab, seed, pad), batch_size=batch_size, shuffle=False, collate_fn=collate)


def _encoded(samples: list[dict]) -> object:
    from transformers import BatchEncoding

    return BatchEncoding(torch.utils.data.default_collate(samples))


def _cut_to_a_length_of_its_own(samples: list[dict]) -> dict:
    batch = torch.utils.data.default_collate(samples)
    length = 3 + int(batch["tokens"][0].sum()) % (batch["tokens"].shape[1] - 2)
    return {k: v[:, :length] for k, v in batch.items()}


class BatchNormBlock(nn.Module):
    """A residual block normalised by BatchNorm: running statistics, buffers that every training forward updates."""

    def __init__(self, dim: int) -> None:
        super().__init__()
        self.block = ResidualBlock(dim)
        self.norm = nn.BatchNorm1d(dim)

    def forward(self, h: torch.Tensor) -> torch.Tensor:
        return self.norm(self.block(h).transpose(1, 2)).transpose(1, 2)


class BatchNormGPT(TinyGPT):
    """TinyGPT whose blocks carry BatchNorm: each micro-batch's forward updates them once, as one process's."""

    def make_net(self) -> Net:
        net = super().make_net()
        net.blocks = nn.ModuleDict({name: BatchNormBlock(self.hparams.dim) for name in net.blocks})
        return net


class NoSkipGPT(TinyGPT):
    """Breaks the seed convention: forward calls the embedding even where it is None."""

    def forward(self, tokens: torch.Tensor) -> torch.Tensor:
        h = self.net.embed(tokens) + self.net.pos[: tokens.shape[1]]
        for block in self.net.blocks.values():
            h = block(h)
        if self.final_norm is not None:
            h = self.final_norm(h)
        return self.net.head(h) if self.net.head is not None else h


class CountingGPT(TinyGPT):
    """Scales each block's output by its position in the loop: a stage pruned to its blocks counts them from 0."""

    def forward(self, tokens: torch.Tensor) -> torch.Tensor:
        h = tokens
        if self.net.embed is not None:
            h = self.net.embed(tokens) + self.net.pos[: tokens.shape[1]]
        for i, block in enumerate(self.net.blocks.values()):
            h = block(h) * (1.0 - 0.1 * i)
        if self.final_norm is not None:
            h = self.final_norm(h)
        return self.net.head(h) if self.net.head is not None else h


class TwiceGPT(TinyGPT):
    """Calls the model twice in one step, which a pipeline cannot run."""

    def training_step(self, batch, batch_idx):
        return self._loss(batch) + self._loss(batch)


class LastRankFailsGPT(TinyGPT):
    """A step that fails on the last rank only (where a pipeline runs it), however it is called."""

    def training_step(self, batch, batch_idx):
        dist = torch.distributed
        if dist.is_initialized() and dist.get_rank() == dist.get_world_size() - 1:
            raise RuntimeError("this step fails on the last rank")
        return super().training_step(batch, batch_idx)


class Core(nn.Module):
    """A plain network; the LightningModule below wraps it and calls it directly."""

    def __init__(self, vocab: int = 32, dim: int = 32, n_layers: int = 4) -> None:
        super().__init__()
        self.embed = nn.Embedding(vocab, dim)
        self.layers = nn.ModuleDict({str(i): ResidualBlock(dim) for i in range(n_layers)})
        self.head = nn.Linear(dim, vocab)

    def forward(self, tokens: torch.Tensor, scale: torch.Tensor) -> torch.Tensor:
        h = self.embed(tokens) if self.embed is not None else tokens
        for layer in self.layers.values():
            h = layer(h) * scale  # every stage needs `scale`: it travels as the call's second argument
        return self.head(h) if self.head is not None else h


class LossSteps(L.LightningModule):
    """Steps that log the loss of ``self._loss(batch)``, the way the test jobs read it."""

    def training_step(self, batch, batch_idx):
        loss = self._loss(batch)
        self.log("train_loss", loss)
        self.log("train_max", loss, reduce_fx="max")
        return loss

    def validation_step(self, batch, batch_idx):
        self.log("val_loss", self._loss(batch))


class WrappedGPT(LossSteps):
    """Keeps the network in ``self.model`` and calls ``self.model(x, scale)`` from a tuple-batch step."""

    def __init__(self, n_layers: int = 4, lr: float = 1e-2, **_: object) -> None:
        super().__init__()
        self.model = Core(n_layers=n_layers)
        self.lr = lr

    def _loss(self, batch: dict) -> torch.Tensor:
        tokens, targets = batch["tokens"], batch["targets"]
        scale = torch.full((tokens.shape[0], 1, 1), 0.9)
        return F.cross_entropy(self.model(tokens, scale).flatten(0, 1), targets.flatten())

    def configure_optimizers(self):
        return torch.optim.Adam(self.parameters(), lr=self.lr)


class InitGPT(TinyGPT):
    """TinyGPT whose every module has an initialiser: it can be built on meta."""

    def make_net(self) -> Net:
        return InitNet(self.hparams.vocab, self.hparams.dim, self.hparams.n_layers, self.hparams.seq)


class ItemGPT(InitGPT):
    """A forward that reads a value (``.item()``): it cannot run on meta tensors."""

    def forward(self, tokens: torch.Tensor) -> torch.Tensor:
        h = super().forward(tokens)
        return h * 0.5 if h.abs().max().item() > 1e6 else h


class ListGPT(TinyGPT):
    """Blocks in an ``nn.ModuleList`` looped over directly, as HF GPT-2, nanoGPT and litgpt keep theirs."""

    def make_net(self) -> Net:
        net = super().make_net()
        net.blocks = nn.ModuleList(net.blocks.values())
        return net

    def forward(self, tokens: torch.Tensor) -> torch.Tensor:
        h = tokens
        if self.net.embed is not None:
            h = self.net.embed(tokens) + self.net.pos[: tokens.shape[1]]
        for block in self.net.blocks:
            h = block(h)
        if self.final_norm is not None:
            h = self.final_norm(h)
        return self.net.head(h) if self.net.head is not None else h


class SequentialGPT(ListGPT):
    """Blocks in an ``nn.Sequential`` that forward calls as one module."""

    def make_net(self) -> Net:
        net = super().make_net()
        net.blocks = nn.Sequential(*net.blocks)
        return net

    def forward(self, tokens: torch.Tensor) -> torch.Tensor:
        h = tokens
        if self.net.embed is not None:
            h = self.net.embed(tokens) + self.net.pos[: tokens.shape[1]]
        h = self.net.blocks(h)
        if self.final_norm is not None:
            h = self.final_norm(h)
        return self.net.head(h) if self.net.head is not None else h


class SequentialNet(LossSteps):
    """The whole network one ``nn.Sequential`` of mixed layers (an embedding, linear layers and activations, a
    head), written for one process: the step calls the container itself (``self.net(tokens)``)."""

    def __init__(
        self, vocab: int = 32, dim: int = 32, n_layers: int = 4, lr: float = 1e-2, optimizer: str = "adamw", **_: object
    ) -> None:
        super().__init__()
        self.save_hyperparameters()
        hidden = [m for _ in range(n_layers) for m in (nn.Linear(dim, dim), nn.GELU())]
        self.net = nn.Sequential(nn.Embedding(vocab, dim), *hidden, nn.Linear(dim, vocab))

    def _loss(self, batch: dict) -> torch.Tensor:
        return F.cross_entropy(self.net(batch["tokens"]).flatten(0, 1), batch["targets"].flatten())

    def configure_optimizers(self):
        if self.hparams.optimizer == "sgd":
            return torch.optim.SGD(self.parameters(), lr=self.hparams.lr)
        return torch.optim.AdamW(self.parameters(), lr=self.hparams.lr)


class Body(nn.Module):
    """The network one level down, whose own forward skips the parts other stages hold."""

    def __init__(self, net: Net, final_norm: nn.Module) -> None:
        super().__init__()
        self.net, self.final_norm = net, final_norm

    def forward(self, tokens: torch.Tensor) -> torch.Tensor:
        return ListGPT.forward(self, tokens)  # type: ignore[arg-type]


class DelegatingGPT(ListGPT):
    """``forward`` delegates to ``self.body(x)``, which holds the network (layers at ``body.net.blocks``), and the
    steps call ``self(x)``: the model is reached through a wrapper, inside the pipeline too."""

    def __init__(self, **kwargs: object) -> None:
        super().__init__(**kwargs)
        self.body = Body(self.net, self.final_norm)
        del self.net, self.final_norm

    def configure_model(self) -> None:
        pass

    def forward(self, tokens: torch.Tensor) -> torch.Tensor:
        return self.body(tokens)


class TiedGPT(ListGPT):
    """GPT-2's tie: the head's weight is the embedding's, so the first and the last stage hold one tensor.
    Every module has an initialiser: it can be built on meta."""

    def make_net(self) -> Net:
        net = InitNet(self.hparams.vocab, self.hparams.dim, self.hparams.n_layers, self.hparams.seq)
        net.blocks = nn.ModuleList(net.blocks.values())
        net.head = nn.Linear(self.hparams.dim, self.hparams.vocab, bias=False)  # nanoGPT's and GPT-2's head
        net.head.weight = net.embed.weight
        return net


class HFGPT2(LossSteps):
    """Hugging Face's ``GPT2LMHeadModel`` from a tiny config (no download), unchanged: its forward skips no part,
    ties the embedding to the head and (``labels=``) computes its own loss; or the step computes cross-entropy
    from ``.logits`` (``logits=True``)."""

    def __init__(
        self, n_layers: int = 4, lr: float = 1e-2, optimizer: str = "adamw", logits: bool = False, **_: object
    ) -> None:
        super().__init__()
        from transformers import GPT2Config, GPT2LMHeadModel

        self.save_hyperparameters()
        config = GPT2Config(
            vocab_size=32, n_positions=8, n_embd=32, n_layer=n_layers, n_head=4, resid_pdrop=0.0, embd_pdrop=0.0,
            attn_pdrop=0.0, use_cache=False, bos_token_id=0, eos_token_id=0,
        )  # fmt: skip
        self.model = GPT2LMHeadModel(config)

    def predict_step(self, batch, batch_idx):
        return self.model(input_ids=batch["tokens"]).logits.argmax(-1)  # a tensor, and not a loss: integer ids

    def _loss(self, batch: dict) -> torch.Tensor:
        tokens, targets = batch["tokens"], batch["targets"]
        if self.hparams.logits:
            return F.cross_entropy(self.model(input_ids=tokens).logits.flatten(0, 1), targets.flatten())
        return self.model(input_ids=tokens, labels=targets).loss

    def configure_optimizers(self):
        if self.hparams.optimizer == "sgd":
            return torch.optim.SGD(self.parameters(), lr=self.hparams.lr, momentum=0.9)
        return torch.optim.AdamW(self.parameters(), lr=self.hparams.lr)


class HFLlama(HFGPT2):
    """Hugging Face's ``LlamaForCausalLM`` (rotary embedding under ``@torch.no_grad()``, grouped-query attention,
    no tie), called with the whole batch as keyword arguments: ``self.model(**batch)``."""

    def __init__(self, n_layers: int = 4, lr: float = 1e-2, optimizer: str = "adamw", **_: object) -> None:
        L.LightningModule.__init__(self)  # not HFGPT2's: a Llama, not a GPT-2
        from transformers import LlamaConfig, LlamaForCausalLM

        self.save_hyperparameters({"n_layers": n_layers, "lr": lr, "optimizer": optimizer})
        config = LlamaConfig(
            vocab_size=32, hidden_size=32, intermediate_size=64, num_hidden_layers=n_layers, num_attention_heads=4,
            num_key_value_heads=2, max_position_embeddings=16, use_cache=False,
        )  # fmt: skip
        self.model = LlamaForCausalLM(config)

    def _loss(self, batch: dict) -> torch.Tensor:
        return self.model(**{"input_ids": batch["tokens"], "labels": batch["targets"]}).loss


class HFOlmo3(HFLlama):
    """Hugging Face's ``Olmo3ForCausalLM``: sliding-window and full attention layers, and one rotary embedding that
    forward calls once per layer type (the tracer names its second call ``rotary_emb@1``)."""

    def __init__(self, n_layers: int = 4, lr: float = 1e-2, optimizer: str = "adamw", **_: object) -> None:
        L.LightningModule.__init__(self)
        from transformers import Olmo3Config, Olmo3ForCausalLM

        self.save_hyperparameters({"n_layers": n_layers, "lr": lr, "optimizer": optimizer})
        config = Olmo3Config(
            vocab_size=32, hidden_size=32, intermediate_size=64, num_hidden_layers=n_layers, num_attention_heads=4,
            num_key_value_heads=2, max_position_embeddings=16, sliding_window=4, use_cache=False, pad_token_id=0,
            bos_token_id=0, eos_token_id=0,
        )  # fmt: skip
        self.model = Olmo3ForCausalLM(config)


class HFViT(HFLlama):
    """Hugging Face's ``ViTForImageClassification``: each sample's tokens an image (one channel, 2 x 4 pixels), its
    first target the class. Traced, its stages hand on an attention mask expanded over the batch (stride 0)."""

    def __init__(self, n_layers: int = 4, lr: float = 1e-2, optimizer: str = "adamw", **_: object) -> None:
        L.LightningModule.__init__(self)
        from transformers import ViTConfig, ViTForImageClassification

        self.save_hyperparameters({"n_layers": n_layers, "lr": lr, "optimizer": optimizer})
        config = ViTConfig(
            image_size=(2, 4), patch_size=1, num_channels=1, hidden_size=32, num_hidden_layers=n_layers,
            num_attention_heads=4, intermediate_size=64, hidden_dropout_prob=0.0, attention_probs_dropout_prob=0.0,
            num_labels=32,
        )  # fmt: skip
        self.model = ViTForImageClassification(config)

    def _loss(self, batch: dict) -> torch.Tensor:
        pixels = batch["tokens"].float().div(32).view(-1, 1, 2, 4)
        return self.model(pixel_values=pixels, labels=batch["targets"][:, 0]).loss


class HFOPT(HFLlama):
    """Hugging Face's ``OPTForCausalLM``: its layers return a view (``reshape``), which torch's split backward (the
    zero-bubble and V schedules) detaches in place."""

    def __init__(self, n_layers: int = 4, lr: float = 1e-2, optimizer: str = "adamw", **_: object) -> None:
        L.LightningModule.__init__(self)
        from transformers import OPTConfig, OPTForCausalLM

        self.save_hyperparameters({"n_layers": n_layers, "lr": lr, "optimizer": optimizer})
        config = OPTConfig(
            vocab_size=32, hidden_size=32, num_hidden_layers=n_layers, ffn_dim=64, num_attention_heads=4, dropout=0.0,
            attention_dropout=0.0, max_position_embeddings=16, word_embed_proj_dim=32, use_cache=False,
        )  # fmt: skip
        self.model = OPTForCausalLM(config)


class HFGPTJ(HFLlama):
    """Hugging Face's ``GPTJForCausalLM``: every layer gathers its rotary table with the model's ``position_ids``,
    an integer tensor the stages hand on (torch's first-step shape inference made it of ``torch.empty``)."""

    def __init__(self, n_layers: int = 4, lr: float = 1e-2, optimizer: str = "adamw", **_: object) -> None:
        L.LightningModule.__init__(self)
        from transformers import GPTJConfig, GPTJForCausalLM

        self.save_hyperparameters({"n_layers": n_layers, "lr": lr, "optimizer": optimizer})
        config = GPTJConfig(
            vocab_size=32, n_embd=32, n_layer=n_layers, n_head=4, rotary_dim=4, n_positions=16, resid_pdrop=0.0,
            embd_pdrop=0.0, attn_pdrop=0.0, use_cache=False, bos_token_id=0, eos_token_id=0,
        )  # fmt: skip
        self.model = GPTJForCausalLM(config)


class HFFalcon(HFLlama):
    """Hugging Face's ``FalconForCausalLM`` (the new decoder architecture, grouped keys and values): its attention
    indexes the fused projection with lists (``qkv[:, :, :, [-2]]``), which the tracer makes tensors of."""

    def __init__(self, n_layers: int = 4, lr: float = 1e-2, optimizer: str = "adamw", **_: object) -> None:
        L.LightningModule.__init__(self)
        from transformers import FalconConfig, FalconForCausalLM

        self.save_hyperparameters({"n_layers": n_layers, "lr": lr, "optimizer": optimizer})
        config = FalconConfig(
            vocab_size=32, hidden_size=32, num_hidden_layers=n_layers, num_attention_heads=4, num_kv_heads=2,
            new_decoder_architecture=True, max_position_embeddings=16, use_cache=False, bos_token_id=0, eos_token_id=0,
        )  # fmt: skip
        self.model = FalconForCausalLM(config)


class HFBertClassifier(HFLlama):
    """Hugging Face's ``BertForSequenceClassification``: its forward reads the pooler's output by position
    (``outputs[1]``), which a stage without the pooler does not have."""

    def __init__(self, n_layers: int = 4, lr: float = 1e-2, optimizer: str = "adamw", **_: object) -> None:
        L.LightningModule.__init__(self)
        from transformers import BertConfig, BertForSequenceClassification

        self.save_hyperparameters({"n_layers": n_layers, "lr": lr, "optimizer": optimizer})
        config = BertConfig(
            vocab_size=32, hidden_size=32, num_hidden_layers=n_layers, num_attention_heads=4, intermediate_size=64,
            hidden_dropout_prob=0.0, attention_probs_dropout_prob=0.0, max_position_embeddings=8, num_labels=32,
        )  # fmt: skip
        self.model = BertForSequenceClassification(config)

    def _loss(self, batch: dict) -> torch.Tensor:
        return self.model(input_ids=batch["tokens"], labels=batch["targets"][:, 0]).loss


class LoraBert(HFBertClassifier):
    """``BertForSequenceClassification`` wrapped by ``get_peft_model`` with ``task_type="SEQ_CLS"``, which trains
    the classifier whole beside LoRA on the queries and values: peft's ``modules_to_save`` copy of it."""

    def __init__(self, n_layers: int = 4, lr: float = 1e-2, optimizer: str = "adamw", **_: object) -> None:
        super().__init__(n_layers, lr, optimizer)
        from peft import LoraConfig, get_peft_model

        config = LoraConfig(r=4, lora_alpha=8, target_modules=["query", "value"], task_type="SEQ_CLS")
        self.model = get_peft_model(self.model, config)


class HFGPT2Logits(HFGPT2):
    def __init__(self, **kwargs: object) -> None:
        super().__init__(**{**kwargs, "logits": True})


class HFGPT2Twice(HFGPT2):
    """Calls the model twice in one step, which a pipeline cannot run."""

    def training_step(self, batch, batch_idx):
        return self._loss(batch) + self._loss(batch)


class HFGPT2Cache(HFGPT2):
    """GPT-2 with its default ``use_cache=True``."""

    def __init__(self, **kwargs: object) -> None:
        super().__init__(**kwargs)
        self.model.config.use_cache = True


class NanoBlock(nn.Module):
    def __init__(self, dim: int, n_heads: int) -> None:
        super().__init__()
        self.ln_1, self.ln_2 = nn.LayerNorm(dim), nn.LayerNorm(dim)
        self.attn = nn.MultiheadAttention(dim, n_heads, batch_first=True)
        self.mlp = nn.Sequential(nn.Linear(dim, 4 * dim), nn.GELU(), nn.Linear(4 * dim, dim))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        h = self.ln_1(x)
        causal = torch.ones(x.shape[1], x.shape[1], dtype=torch.bool, device=x.device).triu(1)
        x = x + self.attn(h, h, h, attn_mask=causal, need_weights=False)[0]
        return x + self.mlp(self.ln_2(x))


class NanoGPT(nn.Module):
    """nanoGPT's shape: ``transformer`` a ModuleDict (wte, wpe, h, ln_f), a tied ``lm_head``, positions from
    ``torch.arange`` and the loss computed in forward when targets are given; forward skips no part."""

    def __init__(self, vocab: int = 32, dim: int = 32, n_layers: int = 4, seq: int = 8) -> None:
        super().__init__()
        self.transformer = nn.ModuleDict(
            dict(wte=nn.Embedding(vocab, dim), wpe=nn.Embedding(seq, dim),
                 h=nn.ModuleList(NanoBlock(dim, 4) for _ in range(n_layers)), ln_f=nn.LayerNorm(dim))
        )  # fmt: skip
        self.lm_head = nn.Linear(dim, vocab, bias=False)
        self.transformer.wte.weight = self.lm_head.weight

    def forward(self, idx: torch.Tensor, targets: torch.Tensor | None = None):
        pos = torch.arange(idx.shape[1], device=idx.device)
        x = self.transformer.wte(idx) + self.transformer.wpe(pos)
        for block in self.transformer.h:
            x = block(x)
        logits = self.lm_head(self.transformer.ln_f(x))
        loss = None if targets is None else F.cross_entropy(logits.flatten(0, 1), targets.flatten())
        return logits, loss


class TensorParallelGPT(TinyGPT):
    """Splits each block's MLP over ``self.device_mesh["tensor_parallel"]`` in ``configure_model`` (column-wise then
    row-wise, Megatron's MLP), as under Lightning's ModelParallelStrategy; one process runs it whole."""

    def configure_model(self) -> None:
        super().configure_model()
        mesh = self.device_mesh
        if mesh is None or mesh["tensor_parallel"].size() == 1:
            return
        from torch.distributed.tensor import DTensor
        from torch.distributed.tensor.parallel import ColwiseParallel, RowwiseParallel, parallelize_module

        for block in self.net.blocks.values():
            if not isinstance(block.ff[0].weight, DTensor):  # configure_model runs again for validate/test
                parallelize_module(
                    block, mesh["tensor_parallel"], {"ff.0": ColwiseParallel(), "ff.2": RowwiseParallel()}
                )


class TensorParallelInitGPT(TensorParallelGPT):
    """``TensorParallelGPT`` with an initialiser for its loose position table, for builds on meta."""

    def make_net(self) -> Net:
        return InitNet(self.hparams.vocab, self.hparams.dim, self.hparams.n_layers, self.hparams.seq)


class SelfShardedGPT(TinyGPT):
    """Applies FSDP itself in ``configure_model``, which the strategy must refuse (it shards each stage itself)."""

    def configure_model(self) -> None:
        super().configure_model()
        from torch.distributed.fsdp import FSDPModule, fully_shard

        for block in self.net.blocks.values():
            if not isinstance(block, FSDPModule):
                fully_shard(block, mesh=self.device_mesh["data_parallel"])


class FrozenGPT(TinyGPT):
    """TinyGPT fine-tuned with its leading parts frozen (embedding, position table, the first half of the blocks):
    with 2 or 4 stages the first stages have nothing to train and the first trainable stage receives an input
    that carries no gradient."""

    def make_net(self) -> Net:
        net = super().make_net()
        frozen = [net.embed, *list(net.blocks.values())[: self.hparams.n_layers // 2]]
        net.pos.requires_grad_(False)
        for module in frozen:
            module.requires_grad_(False)
        return net


class FrozenTensorParallelGPT(FrozenGPT, TensorParallelGPT):
    """``FrozenGPT`` whose blocks' MLPs are split over the tensor-parallel ranks (frozen DTensors among them)."""


class LoraLlama(HFLlama):
    """``HFLlama`` wrapped by ``peft.get_peft_model`` inside the module: LoRA on ``q_proj``/``v_proj`` of the later
    half of the layers only, the rest of the model frozen (layers at ``model.base_model.model.model.layers``)."""

    dora = False

    def __init__(self, n_layers: int = 4, lr: float = 1e-2, optimizer: str = "adamw", **_: object) -> None:
        super().__init__(n_layers, lr, optimizer)
        from peft import LoraConfig, get_peft_model

        later = list(range(n_layers // 2, n_layers))
        config = LoraConfig(r=4, lora_alpha=8, lora_dropout=0.0, target_modules=["q_proj", "v_proj"],
                            layers_to_transform=later, use_dora=self.dora)  # fmt: skip
        self.model = get_peft_model(self.model, config)


class DoraLlama(LoraLlama):
    """``LoraLlama`` with DoRA (``use_dora=True``): each adapted Linear also trains a magnitude per output, whose
    module peft calls with the layer's ``lora_A`` and ``lora_B``; and transformers' gradient checkpointing on every
    other layer, as fine-tune recipes turn it on (``activation_checkpointing_enable``)."""

    dora = True

    def __init__(self, **kwargs: object) -> None:
        super().__init__(**kwargs)
        # transformers 5.17 names it gradient_checkpointing_enable (an alias, deprecated, since)
        model = self.model
        enable = getattr(model, "activation_checkpointing_enable", None) or model.gradient_checkpointing_enable
        enable(every_n_layers=2)


class LoraGPT(TinyGPT):
    """TinyGPT (seed convention, layers at ``net.blocks``) with LoRA injected into every block's two Linears by
    ``peft.inject_adapter_in_model`` (no wrapper: the names stay the module's own); only the adapters train."""

    def __init__(self, **kwargs: object) -> None:
        super().__init__(**kwargs)
        from peft import LoraConfig, inject_adapter_in_model

        inject_adapter_in_model(LoraConfig(r=4, lora_alpha=8, target_modules=["ff.0", "ff.2"]), self.net)
        for name, p in self.named_parameters():
            p.requires_grad_(".lora_" in name)


def renamed_key(name: str) -> str:
    """``init_weights_keys`` for TinyGPT reading a checkpoint whose names differ (``backbone.``, ``ln_f.``)."""
    if name.startswith("net."):
        return "backbone." + name[len("net.") :]
    return name.replace("final_norm.", "ln_f.")


def _moe_config(family: str, n_layers: int, **extra: object):
    """A tiny config of one of transformers' MoE causal LMs (no download): 4 experts, top-2, at the library's
    defaults otherwise (its experts implementation included); ``extra`` overrides any of these.

    DeepSeek-V3's attention (MLA) expands its latent into a key and a value for every attention head, so its
    config must say as many key/value heads: with fewer, SDPA repeats the keys to more heads than the queries
    have, which only a call without an attention mask (``enable_gqa``) happens to survive, not a trace.
    """
    import transformers

    shape = dict(vocab_size=32, hidden_size=32, num_hidden_layers=n_layers, num_attention_heads=4,
                 num_key_value_heads=2, max_position_embeddings=16, use_cache=False, bos_token_id=0,
                 eos_token_id=0, pad_token_id=0)  # fmt: skip
    layer_types = ["sliding_attention", "full_attention"] * (n_layers // 2)
    experts = {
        "mixtral": ("MixtralConfig", dict(intermediate_size=32, num_local_experts=4, num_experts_per_tok=2)),
        "qwen2_moe": ("Qwen2MoeConfig", dict(intermediate_size=32, moe_intermediate_size=16,
                      shared_expert_intermediate_size=32, num_experts=4, num_experts_per_tok=2)),
        "qwen3_moe": ("Qwen3MoeConfig", dict(intermediate_size=32, moe_intermediate_size=16, num_experts=4,
                      num_experts_per_tok=2, head_dim=8)),
        "olmoe": ("OlmoeConfig", dict(intermediate_size=16, num_experts=4, num_experts_per_tok=2)),
        "gpt_oss": ("GptOssConfig", dict(intermediate_size=16, num_local_experts=4, num_experts_per_tok=2,
                    head_dim=8, sliding_window=8, layer_types=layer_types)),
        "deepseek_v3": ("DeepseekV3Config", dict(intermediate_size=32, moe_intermediate_size=16, n_routed_experts=4,
                        num_experts_per_tok=2, n_shared_experts=1, n_group=1, topk_group=1,
                        first_k_dense_replace=1, q_lora_rank=16, kv_lora_rank=16, qk_rope_head_dim=4,
                        qk_nope_head_dim=4, v_head_dim=8, num_key_value_heads=4)),
        "llama4_text": ("Llama4TextConfig", dict(intermediate_size=16, intermediate_size_mlp=32, num_local_experts=4,
                        num_experts_per_tok=1, head_dim=8)),
    }  # fmt: skip
    cls, own = experts[family]
    return getattr(transformers, cls)(**{**shape, **own, **extra})


class HFMoE(HFLlama):
    """One of transformers' MoE causal LMs (``family``) from a tiny config, at the library's defaults, called as
    ``self.model(input_ids=..., labels=...)``."""

    family = "mixtral"
    experts: str | None = None  # the config's experts_implementation, when not the library's default

    def __init__(self, n_layers: int = 4, lr: float = 1e-2, optimizer: str = "adamw", **_: object) -> None:
        L.LightningModule.__init__(self)
        from transformers import AutoModelForCausalLM

        self.save_hyperparameters({"n_layers": n_layers, "lr": lr, "optimizer": optimizer})
        extra = {"experts_implementation": self.experts} if self.experts else {}
        self.model = AutoModelForCausalLM.from_config(_moe_config(self.family, n_layers, **extra))


class HFMoEEager(HFMoE):
    """Mixtral with ``experts_implementation="eager"``: a Python loop over the experts hit (``nonzero``), which
    the tracer cannot export (it runs eagerly once its experts are split over replicas)."""

    experts = "eager"


def transformers_at_least(major: int, minor: int) -> bool:
    """Whether this transformers is that release or later. Before 5.23, the load-balancing loss counts each expert's
    tokens with ``torch.bincount`` and float32 experts' backward reads their token counts in Python: a trace on meta
    cannot run either, and such models are refused there, naming 5.23."""
    import transformers

    return tuple(int(n) for n in transformers.__version__.split(".")[:2]) >= (major, minor)


_FAMILIES = ("mixtral", "qwen2_moe", "qwen3_moe", "olmoe", "gpt_oss", "deepseek_v3", "llama4_text")
MOE = {family: type(f"HFMoE_{family}", (HFMoE,), {"family": family}) for family in _FAMILIES}
MOE["mixtral_eager"] = HFMoEEager


class HFMoERouter(HFMoE):
    """Qwen2-MoE (shared experts) trained with its load-balancing loss (``output_router_logits=True``), as a
    fine-tune writes it: the step adds ``coef * out.aux_loss`` to the language-model loss itself and logs the aux
    loss and the share of the last layer's routing that went to expert 0; ``mask=True`` passes an attention mask
    (ones where the targets are not -100)."""

    family = "qwen2_moe"

    def __init__(self, n_layers: int = 4, lr: float = 1e-2, optimizer: str = "adamw", **kwargs: object) -> None:
        L.LightningModule.__init__(self)
        from transformers import AutoModelForCausalLM

        self.save_hyperparameters({"n_layers": n_layers, "lr": lr, "optimizer": optimizer})
        config = _moe_config(self.family, n_layers, output_router_logits=True, router_aux_loss_coef=0.1)
        self.model = AutoModelForCausalLM.from_config(config)
        self.mask = False

    def _loss(self, batch: dict, log: bool = False) -> torch.Tensor:
        tokens, targets = batch["tokens"], batch["targets"]
        kwargs = {"attention_mask": (targets != -100).long()} if self.mask else {}
        out = self.model(input_ids=tokens, **kwargs)
        lm = F.cross_entropy(out.logits.flatten(0, 1), targets.flatten(), ignore_index=-100)
        if log:
            self.log("train_aux", out.aux_loss)
            chosen = out.router_logits[-1].topk(2, dim=-1).indices
            self.log("train_expert0", (chosen == 0).float().mean())
        return lm + self.model.config.router_aux_loss_coef * out.aux_loss

    def training_step(self, batch, batch_idx):
        loss = self._loss(batch, log=True)
        self.log("train_loss", loss)
        return loss


class HFMoERouterMasked(HFMoERouter):
    def __init__(self, **kwargs: object) -> None:
        super().__init__(**kwargs)
        self.mask = True


class LoraMoE(HFMoE):
    """Qwen3-MoE wrapped by ``peft.get_peft_model``: LoRA on ``q_proj``/``v_proj`` and on the experts' stacked
    weights (peft's ``target_parameters``: its ``ParamWrapper`` adds the product to each weight during the experts'
    forward, the two nested), the rest frozen (layers at ``model.base_model.model.model.layers``)."""

    family = "qwen3_moe"
    LORA = dict(
        r=4,
        lora_alpha=8,
        target_modules=["q_proj", "v_proj"],
        target_parameters=["mlp.experts.gate_up_proj", "mlp.experts.down_proj"],
    )

    def __init__(self, n_layers: int = 4, lr: float = 1e-2, optimizer: str = "adamw", **_: object) -> None:
        super().__init__(n_layers, lr, optimizer)
        from peft import LoraConfig, get_peft_model

        self.model = get_peft_model(self.model, LoraConfig(**self.LORA))


class LoraLlama4(LoraMoE):
    """Llama 4 with LoRA on its experts as peft's documentation writes it (``feed_forward.experts.gate_up_proj``):
    its experts are not transformers' ``@use_experts_implementation`` kind but one module over every expert's
    tokens (``bmm``), stored (experts, in, out); and on a Linear's weight by name (the shared expert's
    ``up_proj.weight``), a matrix peft adapts as plain LoRA."""

    family = "llama4_text"
    LORA = dict(r=4, lora_alpha=8, target_modules=["q_proj", "v_proj"],
                target_parameters=["feed_forward.experts.gate_up_proj", "feed_forward.experts.down_proj",
                                   "shared_expert.up_proj.weight"])  # fmt: skip


class BlockCompiledGPT(TinyGPT):
    """Each block compiled in place by the user (``block.compile()``, as torchtitan and Lightning's guide do), with
    dynamo's ``eager`` backend: dynamo's frames, guards and recompiles without inductor's compile time."""

    def make_net(self) -> Net:
        net = super().make_net()
        for block in net.blocks.values():
            block.compile(backend="eager")
        return net
