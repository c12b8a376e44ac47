"""What this rank holds of the user's module: pruned at the first fit, materialised or sharded, then restored.

Data flows one way: the whole (possibly meta) module -> pruned to this rank's stages (their
optimizer entries kept in the one-process order) -> a view per stage -> materialised on the device,
or materialised and FSDP-sharded unit by unit (``lightning_pp.holding.sharding``) -> the optimizers
re-pointed at the Parameters that now exist -> the checkpoint being resumed, if any.
"""

from __future__ import annotations

import functools
from dataclasses import dataclass, field
from typing import Any

import torch
import torch.distributed as dist
from lightning.pytorch.utilities.rank_zero import rank_zero_info
from torch import nn

from lightning_pp.checkpoints.adapter_weights import open_adapter
from lightning_pp.checkpoints.adapters import parameter_wrappers
from lightning_pp.checkpoints.export import EXPORT_KEY, export_names
from lightning_pp.checkpoints.formats import (
    OptimizerLayout,
    gather_model_state,
    gather_optimizer_state,
    keep_local_parameters,
    optimizer_state_by_name,
)
from lightning_pp.checkpoints.frozen import FROZEN_KEY, FrozenBase, gather_left_out, left_out_weights, read_base
from lightning_pp.checkpoints.pretrained import Pretrained, WeightMap, load_weights, match_weights, open_pretrained
from lightning_pp.checkpoints.restore import PendingRestore, restore_stage
from lightning_pp.holding.compiled import Hook, compile_layers, each_of
from lightning_pp.holding.sharding import repoint_optimizers, shard_stages
from lightning_pp.layout.options import PipelineOptions
from lightning_pp.memory.initializers import start_from_base
from lightning_pp.memory.materialize import materialize
from lightning_pp.memory.recompute import checkpoint_layers
from lightning_pp.split.experts import shard_experts
from lightning_pp.split.pruned import StageModules, pruned_stages
from lightning_pp.split.stage import (
    Placement,
    find_layers,
    guard_forwards,
    model_entries,
    parameterless_parts,
    prune_to_stages,
    stage_view,
)
from lightning_pp.split.traced import Tracer


@dataclass
class Holding:
    """This rank's stages, kept across fit, validate, test and predict."""

    options: PipelineOptions
    shard_over: Any = None  # the replicas' DeviceMesh under data_parallel="fsdp", else None
    experts_over: Any = None  # the replicas' DeviceMesh with expert_parallel_size > 1, else None
    mp_policy: Any = None  # FSDP2's MixedPrecisionPolicy
    pruned: bool = False
    sharded: bool = False
    state_keys: list[str] = field(default_factory=list)  # the whole module's, in one-process order
    trainable: frozenset[str] = frozenset()  # the whole module's parameters that require grad, seen before pruning
    wrapped: dict[str, Any] | None = None  # what peft's parameter wrappers of the whole module adapt, seen so too
    pretrained: tuple[Pretrained, WeightMap] | None = None  # init_weights, its names matched at setup
    adapter: tuple[Pretrained, WeightMap] | None = None  # init_adapter, checked at setup
    optimizer_layouts: list[OptimizerLayout] = field(default_factory=list)
    base: FrozenBase | None = None  # what this rank read from init_weights and left frozen: checkpoints leave it out
    spares: dict[str, nn.Module] = field(default_factory=dict)  # every part without parameters, by name
    roots: dict[int, nn.Module] = field(default_factory=dict)  # each stage's FSDP root, when sharded
    _made: tuple[dict[int, nn.Module], StageModules] | None = None

    def use_mesh(self, mesh: Any) -> None:
        """The world's (data, pipeline, tensor) mesh: FSDP shards, or experts are split, over its replicas."""
        self.shard_over = mesh["data_parallel"] if self.options.data_parallel == "fsdp" else None
        self.experts_over = mesh["data_parallel"] if self.options.expert_parallel_size > 1 else None

    def hold(
        self,
        module: nn.Module,
        placement: Placement,
        stages: list[int],
        optimizers: list[Any],
        fitting: bool,
        device: torch.device,
        tracer: Tracer | None = None,
        pending: PendingRestore | None = None,
    ) -> tuple[nn.Module, dict[int, nn.Module], StageModules]:
        """This rank's stages on its device: pruned for training (the rest is freed), a view otherwise (a later
        fit still sees the whole module). Returns the rank's module, a view per stage, what makes the stage
        modules."""
        optimizers = [_unwrap(o) for o in optimizers]
        names = {id(p): n for n, p in module.named_parameters()}
        aliases: dict[int, list[str]] = {}  # every name of each Parameter: a tied one may keep only its second here
        for n, p in module.named_parameters(remove_duplicate=False):
            aliases.setdefault(id(p), []).append(n)
        held = list(module.parameters())  # the optimizers' Parameters stay alive (ids unique) until re-pointed
        if not self.pruned:  # generation runs them on a stage where they are None (rotary embeddings, dropout)
            self.spares = parameterless_parts(module, placement.parts)
        if fitting and not self.pruned:
            self.state_keys = list(module.state_dict().keys())
            self.trainable = frozenset(n for n, p in module.named_parameters() if p.requires_grad)
            self.wrapped = parameter_wrappers(module)
            prune_to_stages(module, placement, stages)
            guard_forwards(module, placement, stages, model_entries(module, placement.layers_path).values())
            local_ids = {id(p) for p in module.parameters()}
            self.optimizer_layouts = [keep_local_parameters(o, local_ids, names) for o in optimizers]
            self.pruned = True
            if self.options.activation_checkpointing:
                checkpoint_layers(find_layers(module, placement.layers_path), once=self.options.split_backward)
        local = module if self.pruned else stage_view(module, placement, stages)
        if self._made is None or not self.pruned:
            views = {s: stage_view(local, placement, [s]) for s in stages}
            self.sharded = self.shard_over is not None and self.pruned
            if self.sharded:
                made, self.roots = shard_stages(
                    local, views, placement, self.shard_over, self.options, device, self.mp_policy, self.loaded,
                    tracer, self._per_layer(tracer),
                )  # fmt: skip
            else:
                if self.experts_over is not None:
                    shard_experts(local, self.experts_over)
                materialize(local, device, init_fn=self.options.init_fn, loaded=self.loaded)
                per_layer = self._per_layer(tracer)
                made = tracer.stages(views, device, per_layer) if tracer else pruned_stages(views, placement)
            if tracer is None and self.options.compile is not None:  # traced pieces: their layers, in _per_layer
                compile_layers(find_layers(local, placement.layers_path), self.options.compile)
            self._load_pretrained(local, pending)
            self._load_adapter(local, pending)
            self._made = (views, made)
        views, make_stages = self._made
        repoint_optimizers(optimizers, aliases, local)
        del held
        if pending is not None:
            copied = restore_stage(pending, local, optimizers, self.optimizer_layouts)
            rank_zero_info(f"Rank 0 restored {copied / 2**20:.3g} MiB of its own stages' tensors from the checkpoint.")
        return local, views, make_stages

    def check_fit_again(self) -> None:
        if self.pruned:
            raise NotImplementedError(
                "trainer.fit again on a module that an earlier fit already split into pipeline stages is not"
                " supported yet: configure_optimizers would see one stage only. Build a fresh module and resume"
                " with ckpt_path= instead."
            )

    @property
    def views(self) -> dict[int, nn.Module] | None:
        """Each of this rank's stages as a view of its module (None before the first batch)."""
        return None if self._made is None else self._made[0]

    def match_pretrained(self, module: nn.Module) -> None:
        """``init_weights`` and ``init_adapter``: names, shapes (and the adapter's config) against the whole module,
        on every rank alike."""
        if self.pruned:
            return
        adapter = self.options.init_adapter
        if self.options.init_weights is not None and self.pretrained is None:
            pretrained = open_pretrained(self.options.init_weights, module)
            source = "peft's initialisation" if adapter is None else f"init_adapter={str(adapter)!r}"
            self.pretrained = pretrained, match_weights(pretrained, module, self.options.init_weights_keys, source)
        if adapter is not None and self.adapter is None:
            self.adapter = open_adapter(adapter, module)

    def export_names(self, module: nn.Module) -> dict[str, Any]:
        """What a checkpoint keeps for ``consolidate``: the names the weights came in with, what trained
        (other stages' parameters as seen before pruning, this rank's as they are now)."""
        trainable = self.trainable | {n for n, p in module.named_parameters() if p.requires_grad}
        weights = self.pretrained[1] if self.pretrained is not None else None
        return export_names(module, weights, trainable, self.wrapped)

    def whole_state(self, module: nn.Module) -> dict[str, Any]:
        """The whole module's state as a checkpoint must match it: once pruned, other stages' keys (as None)."""
        local = module.state_dict()
        return {k: local.get(k) for k in self.state_keys} if self.pruned else local

    @property
    def loaded(self) -> frozenset[str]:
        """The tensors (qualified names) ``init_weights`` and ``init_adapter`` set: their modules need no initialiser
        on meta."""
        return frozenset(k for source in (self.pretrained, self.adapter) if source is not None for k in source[1].keys)

    def _load_pretrained(self, local: nn.Module, pending: PendingRestore | None) -> None:
        if self.pretrained is None:
            return
        pretrained, weights = self.pretrained
        if pending is not None:  # a resume reads only the frozen base its checkpoint left out
            weights = left_out_weights(weights, pending.left_out, pending.path)
            if not weights.keys:  # its checkpoint holds every tensor
                self.base = None
                rank_zero_info(f"init_weights={str(pretrained.path)!r} is not read: ckpt_path= resumes a run.")
                return
        self.base = read_base(pretrained.path, local, weights)
        read = load_weights(pretrained, weights, local)
        start_from_base(local, weights.keys)
        rank_zero_info(f"Rank 0 read {read / 2**20:.3g} MiB of its own stages' tensors from init_weights.")

    def _load_adapter(self, local: nn.Module, pending: PendingRestore | None) -> None:
        """``init_adapter``, after ``init_weights``: this rank's adapter tensors from the adapter directory."""
        if self.adapter is None:
            return
        if pending is not None:
            rank_zero_info(f"init_adapter={str(self.options.init_adapter)!r} is not read: ckpt_path= resumes a run.")
            return
        read = load_weights(*self.adapter, local)
        rank_zero_info(f"Rank 0 read {read / 2**20:.3f} MiB of its own stages' adapter tensors from init_adapter.")

    def _per_layer(self, tracer: Tracer | None) -> Hook | None:
        """What is done to each traced piece's layers: activation checkpointing (of every layer, or of those the
        model's own gradient checkpointing marks, which a trace does not record), then compile."""
        hooks: list[Hook] = []
        marked = tracer.checkpointed if tracer is not None else frozenset()
        if self.options.activation_checkpointing or marked:
            only = None if self.options.activation_checkpointing else marked
            hooks.append(functools.partial(checkpoint_layers, once=self.options.split_backward, only=only))
        if self.options.compile is not None:
            hooks.append(functools.partial(compile_layers, options=self.options.compile))
        return each_of(hooks)

    def model_state(
        self, module: nn.Module, optimizers: list[Any], writer: bool, group: dist.ProcessGroup | None
    ) -> dict[str, Any]:
        """What a checkpoint keeps of the module's tensors: this rank's own (sharded, or nothing split yet), else
        the whole module's gathered over the pipeline onto the writer; less the frozen base ``init_weights`` holds
        (unless ``save_frozen``)."""
        leave_out = frozenset()
        if self.base is not None and not self.options.save_frozen:
            leave_out = self.base.still_frozen(module, [_unwrap(o) for o in optimizers])
        if not self.pruned or self.options.state_dict_type == "sharded":
            return {k: v for k, v in module.state_dict().items() if k not in leave_out}
        return gather_model_state(module, self.state_keys, group, writer, leave_out=leave_out)

    def checkpoint_entries(self, module: nn.Module, group: dist.ProcessGroup | None) -> dict[str, Any]:
        """What a checkpoint carries beside the state: the names for ``consolidate`` and, where it leaves the frozen
        base out, where that base is and the keys left out on every stage (every rank calls it: a collective)."""
        entries: dict[str, Any] = {EXPORT_KEY: self.export_names(module)}
        if self.base is not None and not self.options.save_frozen:
            left_out = gather_left_out(self.base.names, group)
            if left_out:
                entries[FROZEN_KEY] = self.base.record(left_out)
        return entries

    def optimizer_state(
        self,
        optimizer: Any,
        optimizers: list[Any],
        module: nn.Module,
        sharded: bool,
        writer: bool,
        group: dist.ProcessGroup | None,
    ) -> dict[str, Any]:
        """What a checkpoint keeps of ``optimizer``: keyed by parameter name in a sharded checkpoint (this rank's
        own state), else in the one-process layout, gathered over the pipeline onto the writer."""
        optimizer = _unwrap(optimizer)
        if not self.pruned:  # nothing split yet: this rank holds every parameter
            if not sharded:
                return optimizer.state_dict()
            names = {id(p): n for n, p in module.named_parameters()}
            return optimizer_state_by_name(optimizer, keep_local_parameters(optimizer, set(names), names))
        layout = self.optimizer_layouts[[_unwrap(o) for o in optimizers].index(optimizer)]
        if sharded:
            return optimizer_state_by_name(optimizer, layout)
        return gather_optimizer_state(optimizer, layout, group, writer)


def _unwrap(optimizer: Any) -> torch.optim.Optimizer:
    """The torch optimizer inside Lightning's ``LightningOptimizer``."""
    return getattr(optimizer, "_optimizer", optimizer)
