"""``PipelineStrategy``: the Lightning hooks, each delegating to a plain function or the runner."""

from __future__ import annotations

import contextlib
from collections.abc import Generator
from datetime import timedelta
from os import PathLike
from pathlib import Path
from typing import Any, Literal, Optional, Union

import torch
import torch.distributed as dist
from lightning.fabric.utilities.distributed import (
    _distributed_is_initialized,
    _get_default_process_group_backend_for_device,
    _sync_ddp_if_available,
)
from lightning.fabric.utilities.seed import reset_seed
from lightning.fabric.utilities.types import ReduceOp
from lightning.pytorch import Trainer
from lightning.pytorch.strategies import ParallelStrategy
from lightning.pytorch.strategies.strategy import TBroadcast
from lightning.pytorch.trainer.states import TrainerFn
from lightning.pytorch.utilities.rank_zero import rank_zero_info, rank_zero_only
from lightning_utilities.core.rank_zero import rank_zero_only as utils_rank_zero_only
from torch import Tensor
from typing_extensions import override

from lightning_pp.checkpoints.asynchronous import ShardedSaves
from lightning_pp.checkpoints.formats import is_complete
from lightning_pp.checkpoints.restore import PendingRestore, check_state_keys, open_checkpoint
from lightning_pp.checkpoints.resume import resume_exactly
from lightning_pp.checkpoints.swap import fault_point, swapped_in
from lightning_pp.choose.auto import chosen_options, recorded_choice
from lightning_pp.generation.through import NOT_GENERATION, generate_through, generation_step
from lightning_pp.holding.sharding import check_no_user_sharding, mixed_precision_policy
from lightning_pp.holding.stages import Holding
from lightning_pp.layout import options
from lightning_pp.layout.dtensors import has_dtensors
from lightning_pp.layout.mesh import Groups, Layout, check_same_batch, layout_of, make_groups, vote
from lightning_pp.layout.options import microbatches_for
from lightning_pp.layout.replica_groups import sampler_shard
from lightning_pp.layout.schedule import check_loaders, keep_loader_order
from lightning_pp.lifecycle.launch import PipelineLauncher
from lightning_pp.lifecycle.rendezvous import connect
from lightning_pp.lifecycle.signals import SignalStop, at_evaluation_step, carry_signals_through_store
from lightning_pp.memory.allocator import prepare_process, return_freed_tensors
from lightning_pp.memory.materialize import check_initializers, check_materialized, empty_weights
from lightning_pp.replicas.groups import Alone, join
from lightning_pp.runtime.grads import StepGradients, add_gradients, step_gradients, window_starts
from lightning_pp.runtime.metrics import load_states, sync_metrics_over
from lightning_pp.runtime.precision import count_once, loss_multiplier, pipeline_precision
from lightning_pp.runtime.relay import ReportRelay, predictions_to_first_stage, quiet_sync_advice, replay
from lightning_pp.runtime.step import PipelineRunner
from lightning_pp.runtime.summary import summarize_counted_flops
from lightning_pp.runtime.telemetry import Event
from lightning_pp.runtime.twobw import (
    check_optimizers,
    end_window,
    look_ahead,
    prepare_step,
    runner_for,
    stash_older,
)
from lightning_pp.runtime.weighting import WindowWeights, weights_of
from lightning_pp.split.microbatch import batch_size_of, known_containers, seeded_shuffle, split_batch
from lightning_pp.split.planning import check_module, check_training_setup, learn_placement
from lightning_pp.split.stage import Placement, model_entries
from lightning_pp.split.tied import share_parameters
from lightning_pp.split.traced import Tracer


class PipelineStrategy(ParallelStrategy):
    """Pipeline parallelism for an unchanged LightningModule whose layers sit in an ``nn.ModuleList``,
    ``nn.Sequential`` or ``nn.ModuleDict``.

    Stage ``s`` keeps the ``s``-th run of consecutive layers, parts used before the layers live on
    the first stage and parts used after them on the last. A rank holds one stage under GPipe and
    1F1B, ``stages_per_rank`` stages under torch's multi-stage schedules (loop or V placement).
    The user's own step methods compute the loss and log on the last stage, once per micro-batch;
    what they log reaches every rank as one process would have logged it.

    A model larger than one device is built with its parameters on meta, under
    ``trainer.init_module()`` or in ``configure_model``; each rank then materialises only its own
    stage on its device, initialised by the name rule (``init_fn`` for modules without ``reset_parameters``)
    or read from pretrained weights (``init_weights``), and reads only its own tensors of either and when
    resuming. An eagerly built module is pruned to the rank's stage before it is moved to the device.

    ``split="trace"`` serves forwards that use every part (Hugging Face, nanoGPT): torch's tracer splits the model
    at the same layer boundaries; left out, it is taken for such a forward, and ``layers`` for the container of
    repeated layers. A Parameter several stages use (a tied embedding) lives on each, its gradients summed.

    Replicas of the pipeline hold whole stages (``data_parallel="ddp"``) or shard each stage's parameters,
    gradients and optimizer state with FSDP2 (``"fsdp"``). With ``tensor_parallel_size`` the module's
    ``configure_model`` finds ``self.device_mesh`` (dims data, pipeline and tensor parallel) and applies its
    tensor-parallel plan on meta, as under Lightning's ``ModelParallelStrategy``; the strategy does the rest.
    ``expert_parallel_size`` splits each stage's experts (transformers' MoE models) over its replicas. Arguments
    given as ``"auto"`` (``schedule``, ``n_microbatches``, ``balance``, ...) are chosen at the first batch by
    measuring the model and simulating every layout, under ``memory_limit``. With ``fault_tolerance`` the job is one
    torchft replica group: groups average gradients stage with stage, a dead one is left out, a restarted one heals.
    ``generate`` samples from the model on the ranks that hold it, each stage caching its own layers' keys and values.
    """

    strategy_name = "pipeline"

    def __init__(
        self,
        schedule: str = "1f1b",
        n_microbatches: Union[int, options.Auto, None] = None,
        pipeline_parallel_size: Optional[int] = None,
        layers: Optional[str] = None,
        balance: options.Balance = None,
        stages_per_rank: Union[int, options.Auto, None] = None,
        activation_checkpointing: Union[bool, options.Auto] = False,
        state_dict_type: Literal["full", "sharded"] = "full",
        split: Optional[Literal["prune", "trace"]] = None,
        data_parallel: options.DataParallel = "ddp",
        fsdp_reshard: options.Reshard = "step",
        tensor_parallel_size: int = 1,
        expert_parallel_size: int = 1,
        microbatch_weight: Optional[options.MicrobatchWeight] = None,
        init_fn: Optional[options.InitFn] = None,
        init_weights: Optional[Union[str, PathLike]] = None,
        init_weights_keys: Optional[options.KeyFn] = None,
        timeout: Optional[Union[timedelta, float]] = None,
        process_group_backend: Optional[str] = None,
        async_save: bool = False,
        init_adapter: Optional[Union[str, PathLike]] = None,
        save_frozen: bool = False,
        compile: Union[bool, dict[str, Any]] = False,
        memory_limit: options.MemoryLimit = None,
        checksums: bool = True,
        fault_tolerance: Union[options.FaultTolerance, dict[str, Any], None] = None,
        **kwargs: Any,
    ) -> None:
        super().__init__(**kwargs)
        self.options = options.PipelineOptions(
            schedule, n_microbatches, pipeline_parallel_size, layers, balance, stages_per_rank,
            activation_checkpointing, state_dict_type, split, data_parallel, fsdp_reshard, tensor_parallel_size,
            expert_parallel_size, microbatch_weight, init_fn, init_weights, init_weights_keys, timeout,
            process_group_backend, async_save, init_adapter, save_frozen, compile, memory_limit, checksums,
            fault_tolerance,
        )  # fmt: skip
        self._window = WindowWeights()
        self._process_group_backend = process_group_backend
        self.num_nodes = 1  # Lightning sets the Trainer's num_nodes here
        self._placement: Optional[Placement] = None
        self._tracer: Optional[Tracer] = None
        self._runner: Optional[PipelineRunner] = None
        self._relay: Optional[ReportRelay] = None
        self._holding = Holding(self.options)
        self._saves = ShardedSaves(self.options.async_save, self.options.checksums)
        self._step_grads: StepGradients = []
        self._pending: Optional[PendingRestore] = None
        self._groups = Groups(pp=None, dp=None)
        self._replicas = Alone()
        self._replace_random_samplers = self._fitting = False
        # set by PipelineMonitor: time the next training step's compute and waits on this rank
        self.record_next_step = False

    def __getattr__(self, name: str) -> Any:
        """The arguments read back as attributes (``strategy.schedule``), as on Lightning's own strategies."""
        if name in options.PipelineOptions.__dataclass_fields__ and "options" in self.__dict__:
            return getattr(self.options, name)
        raise AttributeError(f"{type(self).__name__!r} object has no attribute {name!r}")

    # ------------------------------------------------------------------ processes and devices
    @property
    @override
    def root_device(self) -> torch.device:
        assert self.parallel_devices is not None
        return self.parallel_devices[self.local_rank]

    @property
    def num_processes(self) -> int:
        return len(self.parallel_devices) if self.parallel_devices is not None else 0

    @property
    def is_distributed(self) -> bool:
        return True

    @property
    def layout(self) -> Layout:
        """This rank's place in the (replica, stage, tensor-parallel shard) grid."""
        return layout_of(self.options, self.world_size, self.global_rank)

    @property
    def n_stages(self) -> int:
        return self.layout.n_stages

    @property
    @override
    def distributed_sampler_kwargs(self) -> dict[str, Any]:
        # every stage of one pipeline replica must see the same batches: shard by replica (and replica group) only
        return sampler_shard(self.options.fault_tolerance, self.layout.dp, self.layout.replica)

    @override
    def _configure_launcher(self) -> None:
        assert self.cluster_environment is not None
        if not self.cluster_environment.creates_processes_externally:
            self._launcher = PipelineLauncher(self.cluster_environment, self.num_processes, self.num_nodes)

    @override
    def setup_environment(self) -> None:
        self.set_world_ranks()
        layout = self.layout  # checks pipeline_parallel_size before any collective
        super().setup_environment()
        prepare_process(self.root_device, self.num_processes)
        reset_seed()
        backend = self._process_group_backend or _get_default_process_group_backend_for_device(self.root_device)
        self._process_group_backend = backend
        assert self.cluster_environment is not None
        connect(self.cluster_environment, backend, self.options.timeout, self.root_device)
        self._groups = make_groups(layout, self.root_device.type)
        self._wire = self.root_device if backend == "nccl" else torch.device("cpu")  # where messages go from (P2P)
        self._holding.use_mesh(self._groups.mesh)
        self._holding.mp_policy = mixed_precision_policy(getattr(self.precision_plugin, "precision", ""))
        # configure_model applies tensor-parallel plans with it, as under Lightning's ModelParallelStrategy
        self.lightning_module._device_mesh = self._groups.mesh
        if layout.dp > 1 or layout.tp > 1:
            rank_zero_info(layout.describe(self.num_processes))
        else:  # every rank logs the pipeline's exact value: Lightning's advice to sync over ranks does not apply
            quiet_sync_advice()

    def set_world_ranks(self) -> None:
        if self.cluster_environment is not None:
            self.cluster_environment.set_global_rank(self.node_rank * self.num_processes + self.local_rank)
            self.cluster_environment.set_world_size(self.num_nodes * self.num_processes)
        rank_zero_only.rank = utils_rank_zero_only.rank = self.global_rank

    @override
    def setup(self, trainer: Trainer) -> None:
        module = self.lightning_module
        assert module is not None and self.accelerator is not None
        summarize_counted_flops(trainer)
        carry_signals_through_store(trainer)
        if self._placement is None:
            check_module(module, self.options.layers, self.options.balance, self.n_stages)
        self._holding.match_pretrained(module)
        check_initializers(module, self.options.init_fn, self._holding.loaded)
        if not self._holding.pruned:  # an earlier fit sharded it itself
            check_no_user_sharding(module, self.options.tensor_parallel_size)
        check_training_setup(module, self.options.schedule, self.options.n_microbatches, self.layout)
        if self.layout.dp == 1 and self.options.fault_tolerance is None:  # see process_dataloader
            self._replace_random_samplers = keep_loader_order(trainer)
        self.accelerator.setup(trainer)
        self.model = self.precision_plugin.convert_module(module)
        self._fitting = trainer.state.fn == TrainerFn.FITTING
        if self._fitting:
            self._holding.check_fit_again()
            self.setup_optimizers(trainer)
            check_optimizers(self.options.schedule, self.optimizers)
            self._replicas = join(self.options.fault_tolerance, self.global_rank, self.world_size, self.root_device)
            self._pending = self._replicas.heal(trainer, self._pending)  # a group behind the others: a live one's
        self.setup_precision_plugin()
        pipeline_precision(self.precision_plugin, self._groups.pp, self.root_device)

    @override
    def model_to_device(self) -> None:
        """Nothing moves whole: at the first batch each rank moves (or materialises) only its own stage."""

    @override
    @contextlib.contextmanager
    def tensor_init_context(self, empty_init: Optional[bool] = None) -> Generator[None, None, None]:
        """``trainer.init_module()`` and ``configure_model``: parameters on meta unless ``empty_init=False``,
        which builds on the CPU (never the accelerator: the module is pruned before it is moved)."""
        return_freed_tensors(self.root_device)
        building = empty_weights() if empty_init is not False else torch.device("cpu")
        with building, self.precision_plugin.tensor_init_context():
            yield

    # ------------------------------------------------------------------ the pipelined steps
    @override
    def training_step(self, *args: Any, **kwargs: Any) -> Any:
        trainer = self.lightning_module.trainer
        runner = self._prepare("training_step", args, kwargs)  # the stages' Parameters (sharded, real) exist from here
        m, accumulate = self.microbatches_for(batch_size_of(args[0])), trainer.accumulate_grad_batches
        params = [p for p in self.lightning_module.parameters() if p.requires_grad]
        released = window_starts(args, accumulate)
        scale: Union[float, list[float]] = loss_multiplier(self.precision_plugin) / (m * accumulate)
        weights = self._weights_of(args[0], m)
        if weights is not None:  # sum(w_i loss_i) / sum(w_i) over every replica's batch and the window
            shares = self._window.loss_scales(weights, released, self._groups.dp, self.layout.dp)
            scale = [loss_multiplier(self.precision_plugin) * share for share in shares]
        prepare_step(runner, trainer, self, args)  # 2BW: the next batch the step streams into
        with step_gradients(params, released) as self._step_grads, self.precision_plugin.train_step_context():
            return self._pipelined("training_step", args, kwargs, True, scale, runner, weights)

    @override
    def backward(self, closure_loss: Tensor, optimizer: Any, *args: Any, **kwargs: Any) -> Tensor:
        """The schedule already ran backward inside ``training_step``: add its gradients, run the hooks."""
        self.pre_backward(closure_loss)
        closure_loss = self.precision_plugin.pre_backward(closure_loss, self.lightning_module)
        add_gradients(self._step_grads)
        self._step_grads = []
        if not self.lightning_module.trainer.fit_loop._should_accumulate():
            end_window(self._runner)  # 2BW: the optimizer's step follows
            if self.options.microbatch_weight is not None:
                self._window.end_window(self.lightning_module.parameters())
            self._replicas.average(self.lightning_module.trainer)  # fault_tolerance: over the live replica groups
        closure_loss = self.precision_plugin.post_backward(closure_loss, self.lightning_module)
        self.post_backward(closure_loss)
        return closure_loss

    @override
    def validation_step(self, *args: Any, **kwargs: Any) -> Any:
        with self.precision_plugin.val_step_context():
            self._pipelined("validation_step", args, kwargs, train=False)

    @override
    def test_step(self, *args: Any, **kwargs: Any) -> Any:
        with self.precision_plugin.test_step_context():
            self._pipelined("test_step", args, kwargs, train=False)

    @override
    def predict_step(self, *args: Any, **kwargs: Any) -> Any:
        """The last stage's predictions, joined over micro-batches, handed to global rank 0 (or what generates)."""
        with self.precision_plugin.predict_step_context():
            out = generation_step(
                self.lightning_module, self._placement, self.options.layers, args, kwargs, self._ensure_pipeline
            )
            if out is not NOT_GENERATION:
                return out
            self._pipelined("predict_step", args, kwargs, train=False)
        assert self._runner is not None
        return predictions_to_first_stage(self._runner.outputs, self._runner.mb_rows, self.layout, self.global_rank)

    @override
    def on_predict_start(self) -> None:
        trainer = self.lightning_module.trainer
        if self.global_rank != self.layout.first_stage_rank or self.layout.tp_rank != 0:
            # predictions live on the first stage of each replica's shard 0 (global rank 0 for one pipeline)
            trainer.predict_loop.return_predictions = False
        self._check_loaders("predict", trainer.predict_dataloaders, trainer.num_predict_batches)

    def _prepare(self, hook: str, args: tuple, kwargs: dict) -> PipelineRunner:
        if len(args) < 2 or args[1] == 0 or self._runner is None:  # each pass's first batch, a resumed one
            check_same_batch(known_containers(args[0]), self._groups.pp)
        return self._ensure_pipeline(hook, args, kwargs)

    def _pipelined(
        self,
        hook: str,
        args: tuple,
        kwargs: dict,
        train: bool,
        loss_scale: Union[float, list[float]] = 1.0,
        runner: Optional[PipelineRunner] = None,
        weights: Optional[list[float]] = None,
    ) -> Optional[Tensor]:
        if not train:  # a training step's boundary is at the loop's start (see lifecycle.signals)
            at_evaluation_step(self.lightning_module.trainer)
        runner = runner or self._prepare(hook, args, kwargs)
        m = self.microbatches_for(batch_size_of(args[0]))
        weights = weights or self._weights_of(args[0], m)
        report = runner.run(hook, args, kwargs, m, train, loss_scale, train and self.record_next_step, weights)
        self.record_next_step = False
        assert self._relay is not None
        report = self._relay.relay(report)
        if self.global_rank != self.layout.last_stage_rank:
            load_states(self.lightning_module, report.metric_states, self.root_device)
        replay(self.lightning_module, report.logs, self.root_device)
        return None if report.loss is None else report.loss.to(self.root_device)

    def generate(self, input_ids: Tensor, attention_mask: Optional[Tensor] = None, **sampling: Any) -> Tensor:
        """Prompts (left-padded) and their new tokens, on every rank of the pipeline; called on each with the same
        prompts, from a hook every rank runs. ``sampling``: ``generation.sampling.Sampling``; docs/generate.md."""
        ids, self.last_generation = generate_through(
            self.lightning_module, self._holding, self._placement, self.options, self.layout, self._groups.pp,
            self.root_device, self._wire, self.precision_plugin.forward_context(), input_ids, attention_mask, sampling,
        )  # fmt: skip
        return ids

    @property
    def placement(self) -> Optional[Placement]:
        """Which layers and parts each stage holds; decided at the first batch (None before)."""
        return self._placement

    @property
    def last_step_events(self) -> list[Event]:
        """This rank's timed events of the last recorded step (see ``PipelineMonitor``)."""
        return self._runner.last_events if self._runner is not None else []

    def _weights_of(self, batch: Any, m: int) -> Optional[list[float]]:
        return None if (fn := self.options.microbatch_weight) is None else weights_of(fn, split_batch(batch, m))

    def microbatches_for(self, batch_size: int) -> int:
        return microbatches_for(self.options, batch_size, self.layout.pp, self.n_stages)

    def _ensure_pipeline(self, hook: str, args: tuple, kwargs: dict) -> PipelineRunner:
        """At the first batch: learn the module's structure; hold, materialise, shard and restore this rank's stages."""
        if self._runner is not None:
            return self._runner
        if self.options.auto and not self.options.planned:  # schedule="auto" and the like: chosen now,
            with self.precision_plugin.train_step_context():  # costed as training runs, whichever hook comes first
                self.options = self._holding.options = chosen_options(
                    self.lightning_module, args[0], self.options, self.layout, self._groups.pp, self._pending
                )
        module, layout = self.lightning_module, self.layout
        if self._placement is None:
            m = self.microbatches_for(batch_size_of(args[0]))
            self._placement, self._tracer = learn_placement(
                module, self.options, self.n_stages, hook, args, kwargs, m, self.root_device
            )
        sync_metrics_over(module, self._groups.dp)
        local, views, make_stages = self._holding.hold(
            module,
            self._placement,
            layout.stages,
            self.optimizers,
            self._fitting,
            self.root_device,
            self._tracer,
            self._pending,
        )
        self._pending = None
        shared = share_parameters(local, views, self._placement, layout)
        count_once(self.precision_plugin, shared.counted_elsewhere)
        self._runner = runner_for(self.options.schedule)(
            local, layout.stages, make_stages, self.n_stages, self.root_device, self._groups.pp, self.options.schedule,
            model_entries(local, self._placement.layers_path), self._groups.dp, label=layout.pp_rank, shared=shared,
            overlap_replicas=self._tracer is None, sharded=self.options.fsdp_reshard if self._holding.sharded else None,
            forecast=self.options.forecast,
        )  # fmt: skip
        pipeline = layout.pipeline_ranks(layout.replica)
        self._relay = ReportRelay(layout.last_stage_rank, pipeline, self._groups.pp, self._wire, self._groups.host_pp)
        return self._runner

    # ------------------------------------------------------------------ data
    @override
    def process_dataloader(self, dataloader: object) -> object:
        """Every stage must draw the same batches: a RandomSampler on the global RNG may not."""
        loader = seeded_shuffle(dataloader) if self._replace_random_samplers else dataloader
        return look_ahead(loader, self.options.schedule, self.lightning_module.trainer.training)

    @override
    def on_train_start(self) -> None:
        self._check_loaders("training", (t := self.lightning_module.trainer).train_dataloader, [t.num_training_batches])

    @override
    def on_validation_start(self) -> None:
        trainer = self.lightning_module.trainer
        limits = trainer.num_sanity_val_batches if trainer.sanity_checking else trainer.num_val_batches
        self._check_loaders("validation", trainer.val_dataloaders, limits)

    @override
    def on_test_start(self) -> None:
        self._check_loaders("test", (t := self.lightning_module.trainer).test_dataloaders, t.num_test_batches)

    def _check_loaders(self, kind: str, loaders: Any, limits: list[Union[int, float]]) -> None:
        o = self.options
        check_loaders(kind, loaders, limits, o.given_microbatches, o.schedule, self.layout.pp, self.n_stages)

    # ------------------------------------------------------------------ collectives
    @override
    def barrier(self, name: Optional[str] = None) -> None:
        if _distributed_is_initialized():
            dist.barrier(device_ids=[self.root_device.index]) if dist.get_backend() == "nccl" else dist.barrier()

    @override
    def broadcast(self, obj: TBroadcast, src: int = 0) -> TBroadcast:
        box = [obj]
        if _distributed_is_initialized():
            dist.broadcast_object_list(box, src)
        return box[0]

    @override
    def reduce(
        self, tensor: Union[Tensor, Any], group: Optional[Any] = None, reduce_op: Union[ReduceOp, str, None] = "mean"
    ) -> Union[Tensor, Any]:
        """``sync_dist`` reduces over the pipeline replicas (every stage holds its replica's value), as DDP would.

        A world-wide reduce would count each replica once per stage; a pure pipeline has nothing to reduce.
        """
        group = group if group is not None else self._groups.dp
        if isinstance(tensor, Tensor) and (group is not None or self.layout.dp > 1):
            return _sync_ddp_if_available(tensor, group, reduce_op=reduce_op)
        return tensor

    @override
    def reduce_boolean_decision(self, decision: bool, all: bool = True) -> bool:
        """Called on every rank (EarlyStopping, ModelCheckpoint): combine over the whole world."""
        return vote(decision, all, self.root_device) if _distributed_is_initialized() else decision

    # ------------------------------------------------------------------ checkpoints
    @override
    def lightning_module_state_dict(self) -> dict[str, Any]:
        check_materialized(self.lightning_module)
        writer, module = self.layout.writes_full_checkpoint, self.lightning_module
        return self._holding.model_state(module, self.optimizers, writer, self._groups.pp)

    @override
    def optimizer_state(self, optimizer: Any) -> dict[str, Any]:
        writer, sharded = self.layout.writes_full_checkpoint, self.options.state_dict_type == "sharded"
        stash_older(self._runner, optimizer)  # 2BW: the older weight version travels with the optimizer state
        return self._holding.optimizer_state(
            optimizer, self.optimizers, self.lightning_module, sharded, writer, self._groups.pp
        )

    @override
    def load_checkpoint(self, checkpoint_path: Any, weights_only: Optional[bool] = None) -> dict[str, Any]:
        """Either format, from any layout, without reading its tensors: each rank reads its own at the first batch."""
        checkpoint, self._pending = open_checkpoint(Path(checkpoint_path), weights_only, self.options.init_weights)
        resume_exactly(getattr(self.lightning_module, "_trainer", None), checkpoint)  # a fit: where it left off
        return checkpoint

    @override
    def load_model_state_dict(self, checkpoint: Any, strict: bool = True) -> None:
        """Checked against the whole module now; loaded into this rank's stage once it exists."""
        pending, state = self._pending, checkpoint["state_dict"]
        assert pending is not None
        check_state_keys(self._holding.whole_state(self.lightning_module), state, strict, pending)
        pending.model, pending.strict = state, strict

    @override
    def load_optimizer_state_dict(self, checkpoint: Any) -> None:
        assert self._pending is not None
        self._pending.optimizers = checkpoint["optimizer_states"]

    @override
    def save_checkpoint(self, checkpoint: dict[str, Any], filepath: Any, storage_options: Optional[Any] = None) -> None:
        """Written beside ``filepath`` and moved into place once every rank has done its part (see
        ``lightning_pp.checkpoints.swap``): a process that dies at any moment of the save leaves a complete
        checkpoint. Sharded saves may run in the background (``checkpoints.asynchronous``) and record each file's
        size and checksums (``checkpoints.integrity``)."""
        rank = self.global_rank
        checkpoint.update(self._holding.checkpoint_entries(self.lightning_module, self._groups.pp))
        checkpoint.update(recorded_choice(self.options))  # schedule="auto": a resumed fit keeps the choice
        if self.options.state_dict_type == "sharded":  # every rank holds its own piece, or one shard per stage
            every = has_dtensors(self.lightning_module)
            writers, group = (None, None) if every else (self.layout.pipeline_ranks(0), self._groups.pp)
            self._saves.save(checkpoint, filepath, rank, self.barrier, group, writers, self.lightning_module.trainer)
            return
        with swapped_in(Path(filepath), rank, self.barrier, is_complete) as partial:
            if self.is_global_zero:
                self.checkpoint_io.save_checkpoint(checkpoint, partial, storage_options=storage_options)
                fault_point(rank, "torn", tear=partial)

    @override
    def on_train_end(self) -> None:
        self._saves.complete(self.global_rank, self.barrier, end=True)  # async_save: the save in flight lands

    @override
    def on_exception(self, exception: BaseException) -> None:
        if isinstance(exception, SignalStop):  # every rank stopped after the same step: the save in flight lands
            self._saves.complete(self.global_rank, self.barrier, end=True)

    @override
    def teardown(self) -> None:
        assert self.cluster_environment is not None and self.accelerator is not None
        if self._relay is not None:
            self._relay.flush()
        self._runner = self._relay = self._pending = None
        self._replicas.close()
        self.cluster_environment.teardown()
        self.precision_plugin.teardown()
        self.accelerator.teardown()

    @classmethod
    @override
    def register_strategies(cls, strategy_registry: Any) -> None:
        for name, schedule, title in (("pipeline", "1f1b", "1F1B"), ("pipeline_gpipe", "gpipe", "GPipe")):
            strategy_registry.register(name, cls, description=f"Pipeline parallelism with the {title} schedule",
                                       schedule=schedule)  # fmt: skip
