"""One training job, pipelined or plain, that writes what the tests compare.

``python tests/job.py '<json config>'`` runs it (Lightning's launcher re-runs this command for the
other ranks); the tests also call ``run`` in-process for one-process references.
Every rank writes ``rank{r}.json`` (logged values it saw, thread count); rank 0 also writes the
final checkpoint ``final.ckpt`` and ``initial.pt``.
"""

from __future__ import annotations

import functools
import json
import os
import signal
import sys
import threading
import time
from pathlib import Path
from typing import Any

import lightning as L
import torch
from lightning.pytorch.callbacks import Callback, EarlyStopping, ModelCheckpoint
from lightning.pytorch.loggers.logger import Logger
from lightning.pytorch.plugins.precision import MixedPrecision
from torch.utils.data import DataLoader

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))

import torch.distributed.checkpoint  # noqa: E402,F401  (imported before reads are counted)
from models import (  # noqa: E402
    HFGPT2,
    HFGPTJ,
    HFOPT,
    MOE,
    BatchNormGPT,
    BlockCompiledGPT,
    CountingGPT,
    DelegatingGPT,
    DoraLlama,
    FrozenGPT,
    FrozenTensorParallelGPT,
    HFFalcon,
    HFGPT2Cache,
    HFGPT2Logits,
    HFGPT2Twice,
    HFLlama,
    HFMoERouter,
    HFMoERouterMasked,
    HFOlmo3,
    HFViT,
    InitGPT,
    ItemGPT,
    LastRankFailsGPT,
    ListGPT,
    LoraBert,
    LoraGPT,
    LoraLlama,
    LoraLlama4,
    LoraMoE,
    NoSkipGPT,
    SelfShardedGPT,
    SequentialGPT,
    SequentialNet,
    TensorParallelGPT,
    TensorParallelInitGPT,
    TiedGPT,
    TinyGPT,
    TwiceGPT,
    WrappedGPT,
    loader,
    renamed_key,
)

import lightning_pp  # noqa: E402,F401
from lightning_pp.choose.auto import CHOSEN  # noqa: E402
from lightning_pp.layout.dtensors import local_tensor  # noqa: E402
from lightning_pp.runtime.weighting import label_tokens  # noqa: E402
from lightning_pp.split.stage import find_layers  # noqa: E402

KEYS = {"renamed": renamed_key}  # init_weights_keys by name
MODELS = {
    "tiny": TinyGPT,
    "noskip": NoSkipGPT,
    "counting": CountingGPT,
    "twice": TwiceGPT,
    "last_rank_fails": LastRankFailsGPT,
    "wrapped": WrappedGPT,
    "init": InitGPT,
    "item": ItemGPT,
    "list": ListGPT,
    "sequential": SequentialGPT,
    "sequential_net": SequentialNet,
    "delegating": DelegatingGPT,
    "tied": TiedGPT,
    "self_sharded": SelfShardedGPT,
    "tp": TensorParallelGPT,
    "tpinit": TensorParallelInitGPT,
    "gpt2": HFGPT2,
    "gpt2_logits": HFGPT2Logits,
    "gpt2_twice": HFGPT2Twice,
    "gpt2_cache": HFGPT2Cache,
    "llama": HFLlama,
    "olmo3": HFOlmo3,
    "vit": HFViT,
    "gptj": HFGPTJ,
    "falcon": HFFalcon,
    "opt": HFOPT,
    "batchnorm": BatchNormGPT,
    "frozen": FrozenGPT,
    "frozen_tp": FrozenTensorParallelGPT,
    "lora_llama": LoraLlama,
    "dora_llama": DoraLlama,
    "lora_bert": LoraBert,
    "lora_gpt": LoraGPT,
    **MOE,
    "router": HFMoERouter,
    "router_mask": HFMoERouterMasked,
    "lora_moe": LoraMoE,
    "lora_llama4": LoraLlama4,
    "block_compiled": BlockCompiledGPT,
}


class MemoryLogger(Logger):
    """Keeps what Lightning sends to loggers (rank 0 only, as for every logger)."""

    def __init__(self) -> None:
        super().__init__()
        self.rows: list[dict[str, float]] = []

    @property
    def name(self) -> str:
        return "memory"

    @property
    def version(self) -> int:
        return 0

    def log_hyperparams(self, params: Any, *args: Any, **kwargs: Any) -> None:
        pass

    def log_metrics(self, metrics: dict[str, float], step: int | None = None) -> None:
        self.rows.append({"step": step, **{k: float(v) for k, v in metrics.items()}})


class TwoBWReference(Callback):
    """PipeDream-2BW's semantics in one process: every batch of optimizer window n runs on W(n-1) (W(-1) = W(0));
    at the window's end its gradients move to the live weights W(n), which become the next window's, and the
    optimizer steps from them (clipping as Lightning clips). Validation sees the live weights."""

    def __init__(self) -> None:
        self.live: list[torch.Tensor] | None = None
        self.stale: list[torch.Tensor] | None = None
        self.holds_live = True

    def _load(self, module: L.LightningModule, values: list[torch.Tensor]) -> None:
        with torch.no_grad():
            for p, v in zip(module.parameters(), values):
                p.copy_(v)

    def _values(self, module: L.LightningModule) -> list[torch.Tensor]:
        return [p.detach().clone() for p in module.parameters()]

    def on_train_batch_start(self, trainer, pl_module, batch, batch_idx) -> None:
        if self.holds_live:
            self.live = self._values(pl_module)
            self.stale = self.stale or self.live
            self._load(pl_module, self.stale)
            self.holds_live = False

    def on_before_optimizer_step(self, trainer, pl_module, optimizer) -> None:
        self._load(pl_module, self.live)  # the gradients stay: W(n-1)'s, applied to W(n)
        self.stale, self.holds_live = self.live, True

    def state_dict(self) -> dict[str, Any]:
        return {"stale": self.stale} if self.holds_live else {"stale": self.stale, "live": self.live}

    def load_state_dict(self, state_dict: dict[str, Any]) -> None:
        self.stale = state_dict["stale"]

    def on_validation_start(self, trainer, pl_module) -> None:
        if not self.holds_live:
            self._load(pl_module, self.live)

    def on_validation_end(self, trainer, pl_module) -> None:
        if not self.holds_live:
            self._load(pl_module, self.stale)


class Seen(Callback):
    """What ``trainer.callback_metrics`` holds on this rank after each batch and validation."""

    def __init__(self) -> None:
        self.train: list[dict[str, float]] = []
        self.val: list[dict[str, float]] = []

    def on_train_batch_end(self, trainer, *args: Any) -> None:
        self.train.append({k: float(v) for k, v in trainer.callback_metrics.items() if k.startswith("train")})

    def on_validation_epoch_end(self, trainer, *args: Any) -> None:
        if not trainer.sanity_checking:
            self.val.append({k: float(v) for k, v in trainer.callback_metrics.items() if k.startswith("val")})


def _proc(path: str, key: str) -> int:
    return int(next(line for line in open(path) if line.startswith(key)).split()[1])


class Usage(Callback):
    """Bytes this rank read from files during the first training batch (where a resumed stage reads its
    checkpoint), and its peak resident memory during training, counted from just before ``fit``."""

    def __init__(self) -> None:
        open("/proc/self/clear_refs", "w").write("5")  # restart the peak (VmHWM) from here
        self.rss_before = _proc("/proc/self/status", "VmRSS:") * 1024
        self.read_first_batch: int | None = None  # the first batch a run trains, resumed or not
        self.peak_growth = 0

    def on_train_batch_start(self, trainer, pl_module, batch, batch_idx) -> None:
        if self.read_first_batch is None:
            self.read_first_batch = -_proc("/proc/self/io", "rchar:")

    def on_train_batch_end(self, trainer, pl_module, outputs, batch, batch_idx) -> None:
        if self.read_first_batch < 0:
            self.read_first_batch += _proc("/proc/self/io", "rchar:")

    def on_train_end(self, trainer, pl_module) -> None:  # before the final checkpoint's gather
        self.peak_growth = _proc("/proc/self/status", "VmHWM:") * 1024 - self.rss_before


def page_in_kernels(cfg: dict[str, Any]) -> None:
    """One step of a tiny copy of the module before memory is counted, so that the peak counts the rank's
    memory and not torch's code: the first backward pages in ~15 MiB of libtorch_cpu.so, shared by every
    process on the machine."""
    tiny = MODELS[cfg.get("model", "tiny")](**{**_module_kwargs(cfg), "dim": 8, "n_layers": 1, "late": False})
    tokens = torch.zeros(2, tiny.hparams.seq, dtype=torch.long)
    tiny._loss({"tokens": tokens, "targets": tokens}).backward()
    optimizer = tiny.configure_optimizers()
    (optimizer["optimizer"] if isinstance(optimizer, dict) else optimizer).step()


def _dynamo_counters() -> dict[str, dict[str, int]]:
    """Frames dynamo compiled in this process, and its graphs (compiled blocks)."""
    from torch._dynamo.utils import counters

    return {k: dict(v) for k, v in counters.items() if k in ("frames", "stats")}


def _module_kwargs(cfg: dict[str, Any]) -> dict[str, Any]:
    return dict(
        n_layers=cfg.get("n_layers", 4),
        optimizer=cfg.get("optimizer", "adamw"),
        lr=cfg.get("lr", 1e-2),
        sync_dist=cfg.get("sync_dist", False),
        plateau=cfg.get("monitor", False),
        metrics=cfg.get("metrics", False),
        **({"dim": cfg["dim"]} if "dim" in cfg else {}),
        **({"late": True} if cfg.get("build") == "configure_model" else {}),
    )


def build(cfg: dict[str, Any], trainer: L.Trainer | None) -> L.LightningModule:
    """The test module, eagerly or (``build``) on meta: under ``trainer.init_module()`` or late, in
    ``configure_model``; a one-process run gets the pipeline's initial weights from lightning_pp.materialize."""
    how = cfg.get("build")
    kwargs = _module_kwargs(cfg)
    model_cls = MODELS[cfg.get("model", "tiny")]
    if trainer is None and (cfg.get("pretrained") or cfg.get("reference_state")):
        return pretrained_reference(model_cls(**kwargs), cfg)
    if how is None:
        return model_cls(**kwargs)
    if trainer is None:  # one process: the same build, materialised by the pipeline's rule on its device's RNG
        with lightning_pp.empty_weights():
            model = model_cls(**kwargs)
            model.configure_model()
        return lightning_pp.materialize(model, materialize_on(cfg))
    if how == "init_module":
        with trainer.init_module(empty_init=True):
            return model_cls(**kwargs)
    return model_cls(**kwargs)


def pretrained_reference(model: L.LightningModule, cfg: dict[str, Any]) -> L.LightningModule:
    """One process starting from the weights a pipeline reads with ``init_weights``: as Hugging Face loads them
    (``from_pretrained``, back in train mode; wrapped by peft as the module wraps its model), or a state dict in
    the module's own names."""
    if cfg.get("pretrained"):
        from transformers import AutoModelForCausalLM

        hf = AutoModelForCausalLM.from_pretrained(cfg["pretrained"]).train()
        configs = getattr(model.model, "peft_config", None)
        model.model = (
            peft_wrapped(model, hf, configs["default"], cfg.get("init_adapter"), materialize_on(cfg)) if configs else hf
        )
    else:
        model.load_state_dict(torch.load(cfg["reference_state"]))
    return model


def peft_wrapped(
    model: L.LightningModule, hf: torch.nn.Module, config: Any, adapter: str | None, on: str
) -> torch.nn.Module:
    """``hf`` wrapped by peft as ``model`` wraps its own: the adapter directory ``adapter`` as peft loads it, or
    (none) adapters started by the pipeline's rule: put on meta, then ``lightning_pp.materialize``."""
    from peft import PeftModel, get_peft_model

    if adapter:
        return PeftModel.from_pretrained(hf, adapter, is_trainable=True)
    model.model = get_peft_model(hf, config)
    for name, module in model.named_modules():
        if ".lora_" in name:
            for key, p in list(module._parameters.items()):
                if p is not None:
                    module._parameters[key] = torch.nn.Parameter(p.to("meta"), requires_grad=p.requires_grad)
    return lightning_pp.materialize(model, on).model


def materialize_on(cfg: dict[str, Any]) -> str:
    """Where a one-process run materialises: a rank draws its stage's tensors with its device's generator (CUDA's
    differ from the CPU's for the same seed)."""
    return "cuda" if cfg.get("accelerator") == "cuda" else "cpu"


class Overflow(Callback):
    """Under 16-mixed: makes the first layer's gradients inf at one step (on global rank 0 only, where that
    layer sits on the first stage); records each optimizer step's loss scale and whether this rank's
    parameters moved."""

    def __init__(self, step: int | None) -> None:
        self.step, self.scales, self.moved = step, [], []
        self._before: dict[str, torch.Tensor] = {}
        self._hooks: list[Any] = []

    def on_train_batch_start(self, trainer, pl_module, batch, batch_idx) -> None:
        if batch_idx % trainer.accumulate_grad_batches == 0:
            self._before = {
                n: local_tensor(p).detach().clone() for n, p in pl_module.named_parameters() if not p.is_meta
            }
        blocks = getattr(pl_module.net, "blocks", None) or {}
        if trainer.global_step == self.step and trainer.global_rank == 0 and "b0" in blocks:
            self._hooks = [p.register_hook(lambda g: g * float("inf")) for p in blocks["b0"].parameters()]

    def on_train_batch_end(self, trainer, pl_module, outputs, batch, batch_idx) -> None:
        for hook in self._hooks:
            hook.remove()
        self._hooks = []
        if (batch_idx + 1) % trainer.accumulate_grad_batches == 0:  # after the optimizer step
            self.scales.append(trainer.precision_plugin.scaler.get_scale())
            after = dict(pl_module.named_parameters())  # this rank's stages once the first batch pruned the module
            self.moved.append(
                any(not torch.equal(local_tensor(after[n]), p) for n, p in self._before.items() if n in after)
            )


def process_running(pid: int) -> bool:
    try:
        return Path(f"/proc/{pid}/stat").read_text().split(") ")[1][0] not in "ZX"
    except (FileNotFoundError, IndexError):
        return False


class Pid(Callback):
    """Records each rank's pid (so tests can check no rank outlives the job) and kills ranks on request: ``kills``
    maps a launcher's attempt (``TORCHELASTIC_RESTART_COUNT``) to ``[rank, batch, where]``, the batch counted over
    epochs, ``where`` "start" (before the batch) or "step" (after its backward, before the optimizer step). A fourth
    element "STOP" stops the rank instead (SIGSTOP); it is then killed once a peer has exited, as torchrun's agent
    kills the rest of a failed job, and ``stopped`` records how long after the stop that was."""

    def __init__(self, out: Path, kills: dict[str, list]) -> None:
        self.out, self.kill = out, kills.get(os.environ.get("TORCHELASTIC_RESTART_COUNT", "0"))

    def setup(self, trainer, pl_module, stage: str) -> None:
        (self.out / f"pid{trainer.global_rank}").write_text(str(os.getpid()))
        attempt = os.environ.get("TORCHELASTIC_RESTART_COUNT", "0")
        (self.out / f"attempt{attempt}_rank{trainer.global_rank}").touch()

    def _maybe_die(self, trainer, where: str) -> None:
        if self.kill is not None and self.kill[2] == where and trainer.global_rank == self.kill[0]:
            if trainer.fit_loop.epoch_loop.total_batch_idx == self.kill[1]:
                if self.kill[3:] == ["STOP"]:
                    self._killed_after_a_peer_exits(trainer.world_size, trainer.global_rank)
                    os.kill(os.getpid(), signal.SIGSTOP)
                os.kill(os.getpid(), signal.SIGKILL)

    def _killed_after_a_peer_exits(self, world_size: int, rank: int) -> None:
        stopped, start = os.getpid(), time.monotonic()
        peers = [int((self.out / f"pid{r}").read_text()) for r in range(world_size) if r != rank]
        if os.fork() == 0:
            while all(process_running(p) for p in peers) and time.monotonic() - start < 300:
                time.sleep(0.1)
            (self.out / "stopped").write_text(str(time.monotonic() - start))
            os.kill(stopped, signal.SIGKILL)
            os._exit(0)

    def on_train_batch_start(self, trainer, *args) -> None:
        self._maybe_die(trainer, "start")

    def on_before_optimizer_step(self, trainer, *args) -> None:
        self._maybe_die(trainer, "step")


class Signals(Callback):
    """Sends signals to ranks mid-step, as a scheduler or an operator would: ``signals`` lists ``[rank, batch, name]``
    (the batch counted over epochs, ``name`` "TERM", "INT" or "USR1"; a fourth element "val": the first validation's
    batch), each sent ``delay`` seconds after that batch
    began, from a thread of the rank's own process; each batch takes ``pace`` seconds more. Every rank records where
    it stopped (``stopped{rank}.json``)."""

    def __init__(self, out: Path, signals: list[list], pace: float = 0.0, delay: float = 0.05) -> None:
        self.out, self.signals, self.pace, self.delay = out, signals, pace, delay

    def on_train_batch_start(self, trainer, pl_module, batch, batch_idx) -> None:
        self._maybe_signal(trainer, trainer.fit_loop.epoch_loop.total_batch_idx, "train")

    def on_validation_batch_start(self, trainer, pl_module, batch, batch_idx, dataloader_idx=0) -> None:
        self._maybe_signal(trainer, batch_idx, "val")

    def _maybe_signal(self, trainer, batch_idx: int, where: str) -> None:
        time.sleep(self.pace)  # steps of a known length: a signal's news reaches every rank within a few
        for rank, at, name, *during in self.signals:
            if rank == trainer.global_rank and batch_idx == at and (during or ["train"])[0] == where:
                (self.out / f"signalled{rank}").write_text(str(time.time()))
                signum = getattr(signal, f"SIG{name}")
                threading.Timer(self.delay, os.kill, (os.getpid(), signum)).start()

    def on_exception(self, trainer, pl_module, exception: BaseException) -> None:
        where = {"step": trainer.global_step, "batches": trainer.fit_loop.epoch_loop.total_batch_idx,
                 "val_batches": trainer.fit_loop.epoch_loop.val_loop.batch_progress.current.ready,
                 "exception": type(exception).__name__, "code": getattr(exception, "code", None),
                 "received_sigterm": trainer.received_sigterm, "time": time.time()}  # fmt: skip
        (self.out / f"stopped{trainer.global_rank}.json").write_text(json.dumps(where))


_COLLECTIVES = ("broadcast", "all_reduce", "all_gather", "all_gather_into_tensor", "all_gather_object", "barrier",
                "broadcast_object_list", "reduce", "reduce_scatter", "reduce_scatter_tensor", "gather", "scatter",
                "all_to_all", "all_to_all_single", "monitored_barrier", "gather_object", "scatter_object_list")  # fmt: skip


class Collectives(Callback):
    """Counts the collectives each training step calls through ``torch.distributed`` (every function above, whoever
    calls it; each call goes through), from ``on_train_batch_start`` to the next batch's start (the optimizer step,
    the loops' own work and the logging between them included), by the size of the group."""

    def __init__(self) -> None:
        self.per_step: list[dict[str, int]] = []
        self._counts: dict[str, int] | None = None
        dist = torch.distributed
        for name in _COLLECTIVES:
            original = getattr(dist, name)
            counted = functools.partial(self._call, name, original)
            setattr(dist, name, counted)
            setattr(dist.distributed_c10d, name, counted)

    def _call(self, name: str, original: Any, *args: Any, **kwargs: Any) -> Any:
        if self._counts is not None:
            group = kwargs.get("group")
            key = f"{name}@{'world' if group is None else torch.distributed.get_world_size(group)}"
            self._counts[key] = self._counts.get(key, 0) + 1
        return original(*args, **kwargs)

    def on_train_batch_start(self, trainer, *args) -> None:
        if self._counts is not None:
            self.per_step.append(self._counts)
        self._counts = {}

    def on_train_end(self, trainer, *args) -> None:
        if self._counts is not None:
            self.per_step.append(self._counts)
        self._counts = None


def run(cfg: dict[str, Any]) -> dict[str, Any]:
    out = Path(cfg["out"])
    out.mkdir(parents=True, exist_ok=True)
    if cfg.get("threads"):
        torch.set_num_threads(cfg["threads"])
    L.seed_everything(cfg.get("seed", 0), verbose=False)
    batch = cfg.get("batch", 8)
    data = dict(pad=cfg.get("pad", False), vary=cfg.get("vary", False), encoded=cfg.get("encoded", False))
    train = loader(cfg.get("n_train", 64), batch, seed=0, **data)
    val = loader(cfg.get("n_val", 32), cfg.get("val_batch", batch), seed=1, **data)
    reload = functools.partial(DataLoader, train.dataset, batch_size=batch, collate_fn=train.collate_fn)
    if cfg.get("reverse_within"):
        # micro-batches of each pipelined batch in reverse, as a schedule that runs backward last-first sums them
        n, full = cfg.get("n_train", 64), cfg["reverse_within"]
        order = [i for start in range(0, n, full) for k in reversed(range(start, min(start + full, n), batch))
                 for i in range(k, min(k + batch, n))]  # fmt: skip
        train = reload(sampler=order)
    if cfg.get("replicas_order"):
        # the samples Lightning's DistributedSampler gives pipeline replicas (or DDP), drawn by one process: with
        # the replicas' combined batch each step sees the same samples as all replicas together
        sampler = torch.utils.data.DistributedSampler(train.dataset, num_replicas=1, rank=0, seed=cfg.get("seed", 0))
        train = reload(sampler=sampler)
    if cfg.get("bad_sampler"):
        # shards by global rank: the stages of one pipeline replica would load different batches
        rank, world = int(os.environ.get("RANK", os.environ.get("LOCAL_RANK", 0))), cfg["devices"]
        sampler = torch.utils.data.DistributedSampler(train.dataset, num_replicas=world, rank=rank, shuffle=False)
        train = reload(sampler=sampler)
    if cfg.get("shuffle"):  # what Lightning gives replicas: a sampler that Lightning tells each epoch
        sampler = torch.utils.data.DistributedSampler(train.dataset, num_replicas=1, rank=0, seed=cfg.get("seed", 0))
        train = reload(sampler=sampler)
    if cfg.get("resumable"):  # Lightning saves its position: a resumed run reads on where the checkpoint was
        from torchdata.stateful_dataloader import StatefulDataLoader

        train = StatefulDataLoader(
            train.dataset, batch_size=train.batch_size, sampler=train.sampler, collate_fn=train.collate_fn
        )
    if cfg["strategy"] == "single":
        strategy: Any = "auto"
        devices = 1
    elif cfg["strategy"] == "ddp":
        strategy, devices = "ddp", cfg["devices"]
    else:
        strategy = lightning_pp.PipelineStrategy(
            schedule=cfg.get("schedule", "1f1b"),
            n_microbatches=cfg.get("m"),
            layers=cfg.get("layers", "net.blocks"),
            balance=cfg.get("balance"),
            stages_per_rank=cfg.get("stages_per_rank"),
            activation_checkpointing=cfg.get("activation_checkpointing", False),
            state_dict_type=cfg.get("state_dict_type", "full"),
            split=cfg.get("split", "prune"),
            pipeline_parallel_size=cfg.get("pp"),
            data_parallel=cfg.get("data_parallel", "ddp"),
            fsdp_reshard=cfg.get("fsdp_reshard", "step"),
            tensor_parallel_size=cfg.get("tp", 1),
            expert_parallel_size=cfg.get("ep", 1),
            microbatch_weight=functools.partial(label_tokens, key="targets") if cfg.get("weighted") else None,
            timeout=cfg.get("timeout", 60),
            init_weights=cfg.get("pretrained") or cfg.get("init_weights"),
            init_weights_keys=KEYS.get(cfg.get("init_weights_keys")),
            init_adapter=cfg.get("init_adapter"),
            async_save=cfg.get("async_save", False),
            save_frozen=cfg.get("save_frozen", False),
            compile=cfg.get("compile", False),
            memory_limit=cfg.get("memory_limit"),
        )
        devices = cfg["devices"]
    logger, seen = MemoryLogger(), Seen()
    callbacks: list[Callback] = [seen, Pid(out, cfg.get("kills", {}))]
    if cfg.get("signals"):
        callbacks.append(Signals(out, cfg["signals"], cfg.get("pace", 0.0)))
    collectives = Collectives() if cfg.get("count_collectives") else None
    if collectives is not None:
        callbacks.append(collectives)
    if cfg.get("reference_2bw"):
        callbacks.append(TwoBWReference())
    os.environ.update(cfg.get("env", {}))
    if cfg.get("slurm"):  # what srun gives each task of a one-node job (Lightning then requeues on SIGUSR1)
        os.environ.update(SLURM_NTASKS=str(cfg["devices"]), SLURM_NTASKS_PER_NODE=str(cfg["devices"]),
                          SLURM_PROCID=os.environ["RANK"], SLURM_LOCALID=os.environ["LOCAL_RANK"], SLURM_NODEID="0",
                          SLURM_JOB_ID="4242", SLURM_JOB_NAME="pp", SLURM_NODELIST="127.0.0.1")  # fmt: skip
        os.environ.pop("TORCHELASTIC_RUN_ID")  # Lightning prefers torchelastic's environment to SLURM's
    os.environ.update(cfg.get("attempt_env", {}).get(os.environ.get("TORCHELASTIC_RESTART_COUNT", "0"), {}))
    if cfg.get("monitor_pipeline"):
        callbacks.append(lightning_pp.PipelineMonitor(dirpath=out))
    if cfg.get("save_every"):
        every = ModelCheckpoint(cfg.get("ckpt_dir", out / "ckpts"), "{step}", every_n_train_steps=cfg["save_every"],
                                save_top_k=-1, save_last=cfg.get("save_last"))  # fmt: skip
        callbacks.append(every)
    if cfg.get("monitor"):
        best = ModelCheckpoint(dirpath=out / "ckpts", filename="best", monitor="val_loss", save_top_k=1)
        callbacks += [best, EarlyStopping(monitor="val_loss", patience=10)]
    precision: dict[str, Any] = {"precision": cfg.get("precision", "32-true")}
    if precision["precision"] == "16-mixed-cpu":  # real fp16 autocast and a GradScaler on the CPU
        scaler = torch.amp.GradScaler("cpu", init_scale=cfg.get("init_scale", 1024.0), growth_interval=4)
        precision = {"plugins": [MixedPrecision("16-mixed", "cpu", scaler=scaler)]}
        callbacks.append(Overflow(cfg.get("inf_step")))
    trainer = L.Trainer(
        accelerator=cfg.get("accelerator", "cpu"),
        devices=devices,
        num_nodes=cfg.get("num_nodes", 1),
        strategy=strategy,
        max_steps=cfg.get("max_steps", -1),
        max_epochs=cfg.get("max_epochs", 1),
        limit_val_batches=cfg.get("limit_val_batches"),
        gradient_clip_val=cfg.get("clip"),
        accumulate_grad_batches=cfg.get("accumulate", 1),
        **precision,
        logger=logger,
        callbacks=callbacks,
        log_every_n_steps=1,
        enable_checkpointing=bool(cfg.get("monitor") or cfg.get("save_every")),
        val_check_interval=cfg.get("val_check_interval"),
        enable_progress_bar=False,
        enable_model_summary=False,
        num_sanity_val_steps=cfg.get("sanity", 2),
    )
    model = build(cfg, None if cfg["strategy"] == "single" else trainer)
    # one process compiled as compile=True compiles: inductor fuses and reorders arithmetic; dynamo's eager backend
    # runs the captured operations as they are, so one process runs them uncompiled (no second compile per layer)
    compiled = cfg.get("compile")
    if cfg["strategy"] == "single" and compiled and (compiled is True or compiled.get("backend") != "eager"):
        for block in find_layers(model, cfg.get("blocks", "net.blocks")).values():
            block.compile(**({} if compiled is True else compiled))
    whole_bytes = sum(p.numel() * p.element_size() for p in model.parameters())
    if trainer.global_rank == 0 and not any(p.is_meta for p in model.parameters()):
        torch.save(model.state_dict(), out / "initial.pt")
    if cfg.get("page_in"):
        page_in_kernels(cfg)
    usage = Usage()
    trainer.callbacks.append(usage)
    if cfg.get("validate_from"):  # validation alone, from a checkpoint
        trainer.validate(model, val, ckpt_path=cfg["validate_from"], verbose=False, weights_only=cfg.get("weights_only"))
        return {}
    trainer.fit(model, train, val, ckpt_path=cfg.get("resume"), weights_only=cfg.get("weights_only"))
    trainer.save_checkpoint(out / "final.ckpt")  # a directory when state_dict_type="sharded"
    result = {
        "rank": trainer.global_rank,
        "logged": logger.rows,
        "train": seen.train,
        "val": seen.val,
        "threads": torch.get_num_threads(),
        "loss_steps": getattr(model, "loss_steps", 0),
        "world": trainer.world_size,
        "node_rank": trainer.node_rank,
        "local_rank": trainer.local_rank,
        "lr": [g["lr"] for g in trainer.optimizers[0].param_groups],
        "params": sorted(n for n, _ in model.named_parameters()),
        "param_bytes": sum(p.numel() * p.element_size() for p in model.parameters()),
        "local_param_bytes": sum(local_tensor(p).numel() * p.element_size() for p in model.parameters()),
        "meta_params": sum(p.is_meta for p in model.parameters()),
        "dynamo": _dynamo_counters(),
        "chosen": {k: getattr(trainer.strategy.options, k) for k in CHOSEN} if cfg["strategy"] == "pipeline" else {},
        "expert_bytes": [
            sum(f(p).numel() * p.element_size() for n, p in model.named_parameters() if ".experts." in n)
            for f in (local_tensor, lambda p: p)
        ],  # fmt: skip
        "whole_bytes": whole_bytes,
        "peak_growth": usage.peak_growth,
        "read_first_batch": usage.read_first_batch,
        "param_devices": sorted({str(p.device) for p in model.parameters()}),
        "backend": torch.distributed.get_backend() if torch.distributed.is_initialized() else None,
        "scale": scaler.get_scale() if (scaler := getattr(trainer.precision_plugin, "scaler", None)) else None,
    }
    if collectives is not None:
        result["collectives"] = collectives.per_step
    if "plugins" in precision:
        overflow = next(c for c in callbacks if isinstance(c, Overflow))
        result["scales"], result["moved"] = overflow.scales, overflow.moved
    if cfg.get("monitor"):
        result["best_score"] = float(trainer.checkpoint_callback.best_model_score)
    if cfg.get("predict"):
        predictions = trainer.predict(model, val)
        result["predictions_none"] = predictions is None
        if trainer.global_rank == 0:
            torch.save(predictions, out / "predictions.pt")
    if cfg.get("test"):
        trainer.validate(model, val, verbose=False)
        result["validate"] = {k: float(v) for k, v in trainer.callback_metrics.items() if k.startswith("val")}
    if cfg.get("validate_ckpt"):  # a fresh module (built the same way) validated from the checkpoint just written
        trainer.validate(build(cfg, trainer), val, ckpt_path=out / "final.ckpt", verbose=False)
        result["validate_ckpt"] = {k: float(v) for k, v in trainer.callback_metrics.items() if k.startswith("val")}
    (out / f"rank{trainer.global_rank}.json").write_text(json.dumps(result))
    return result


if __name__ == "__main__":
    run(json.loads(sys.argv[1]))
