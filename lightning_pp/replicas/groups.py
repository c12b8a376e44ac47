"""torchft replica groups around the pipeline: each rank a Manager for its position, so that the ranks
holding the same stage (and shard) in every group average gradients with one another.

One step of a group, on every rank: the quorum (which groups are live) when the optimizer is about to
step, the gradients averaged over the live groups at the window's end (before clipping, as one process
clips the mean), then a vote inside the group: the optimizer steps only if torchft says the step commits.
A step that did not commit leaves no trace: no optimizer or step-interval scheduler step, and Lightning's
``global_step`` taken back. A group that starts while others train (torchrun restarted it) heals in its
first quorum, before its loop begins: each rank receives its counterpart's tensors
(``checkpoints.peer``) and the Lightning state a checkpoint at the counterpart's last step would hold
(loops, data position, callbacks, schedulers), and resumes from them as from a checkpoint.

The facts this rests on (torchft 0.2.0, DESIGN section 13): quorum and commit are agreed inside a group;
a gradient average that fails marks the step uncommitted; the quorum is synchronous here, so a healed
group takes part in the step it joins.
"""

from __future__ import annotations

import copy
import os
import socket
import time
import urllib.request
import zlib
from datetime import timedelta
from pathlib import Path
from typing import Any, Callable, Optional
from urllib.parse import urlparse

import lightning
import torch
from lightning.pytorch import Callback, Trainer
from lightning.pytorch.trainer import call

from lightning_pp.checkpoints.peer import rank_pieces
from lightning_pp.checkpoints.restore import PendingRestore
from lightning_pp.checkpoints.resume import resume_exactly
from lightning_pp.errors import PipelineConfigError
from lightning_pp.layout.dtensors import local_tensor
from lightning_pp.layout.replica_groups import FaultTolerance
from lightning_pp.lifecycle.rendezvous import store_address
from lightning_pp.lifecycle.signals import leave_at_a_stop_signal, stop_at_once
from lightning_pp.runtime.precision import grad_scaler

_KEY = "lightning_pp"  # this package's entry in the state torchft hands a healing group
_BUCKET = 2**25  # elements averaged in one call


class Alone:
    """No fault tolerance: every step commits, nothing is averaged across groups."""

    def heal(self, trainer: Trainer, pending: Optional[PendingRestore]) -> Optional[PendingRestore]:
        return pending

    def average(self, trainer: Trainer) -> None:
        pass

    def close(self) -> None:
        pass


class Replicas(Alone):
    """This rank's place among the replica groups (``join``)."""

    def __init__(self, manager: Any, config: FaultTolerance) -> None:
        self.manager, self.config = manager, config
        self._snapshot: dict[str, Any] = {}
        self._trainer: Optional[Trainer] = None
        self._received: Optional[dict[str, Any]] = None
        self._setting_up = True  # only the first quorum, before the loop, may heal this group
        self._quorum_open = False
        self._committed = True
        self._checked_quorum: Optional[int] = None  # the quorum whose groups were found to hold the same weights
        self._uncommitted = 0  # steps in a row
        manager.register_state_dict_fn(_KEY, self._receive, self._send)
        self._undo_leave = leave_at_a_stop_signal(lambda: manager.shutdown(wait=False))

    # ---------------------------------------------------------------- healing
    def heal(self, trainer: Trainer, pending: Optional[PendingRestore]) -> Optional[PendingRestore]:
        """The group's first quorum, at set-up: a group behind the others takes a live group's state now."""
        _check_trainer(trainer)
        self._trainer = trainer
        for optimizer in trainer.optimizers:
            optimizer.step = self._gated(optimizer.step)  # type: ignore[method-assign]
        stepwise = {id(c.scheduler) for c in trainer.lr_scheduler_configs if c.interval == "step"}
        module = trainer.lightning_module  # a scheduler's own attributes would travel in its state_dict
        module.lr_scheduler_step = self._if_committed(module.lr_scheduler_step, stepwise)  # type: ignore[method-assign]
        trainer.callbacks.append(_Snapshot(self))
        self._meet()  # a healing group's state arrives in _receive
        self._quorum_open, self._setting_up = True, False
        if self._received is None:
            return pending
        state, self._received = self._received, None
        resume_exactly(trainer, state)
        connector = trainer._checkpoint_connector
        connector._loaded_checkpoint = state  # Lightning restores loops, optimizers and schedulers after setup
        connector.restore_callbacks()
        return PendingRestore(Path("<a live replica group>"), sharded=False, pieces=state.pop("pieces"))

    def _meet(self) -> None:
        with stop_at_once(lambda: self.manager.shutdown(wait=False)):
            self.manager.start_quorum(allow_heal=True)

    def _send(self) -> dict[str, Any]:
        """Called in torchft's quorum thread while this rank's step waits for the quorum: nothing moves."""
        trainer = self._trainer
        if trainer is None or not self._snapshot:
            raise PipelineConfigError("A group asked this one for its state before this one trained a step.")
        return {**self._snapshot, "pieces": rank_pieces(trainer.lightning_module, trainer.optimizers)}

    def _receive(self, state: dict[str, Any]) -> None:
        if not self._setting_up:
            raise RuntimeError(
                f"Replica group {self.config.group} fell behind the live groups while training (a step that committed"
                " for them did not for it): its weights, optimizer and data position would no longer be theirs. It"
                " stops, to heal from them when it restarts (run each group under torchrun --max_restarts, or a"
                " scheduler that restarts it)."
            )
        self._received = state

    def snapshot(self, trainer: Trainer) -> None:
        """What a checkpoint at this batch's end would hold of Lightning's state (``_Snapshot``)."""
        self._snapshot = copy.deepcopy({
            "loops": {"fit_loop": trainer.fit_loop.state_dict()},
            "callbacks": call._call_callbacks_state_dict(trainer),
            "lr_schedulers": [c.scheduler.state_dict() for c in trainer.lr_scheduler_configs],
            "global_step": trainer.global_step,
            "epoch": trainer.current_epoch,
            "optimizer_states": [],  # the optimizers' state travels in the pieces
            "pytorch-lightning_version": lightning.__version__,
        })  # fmt: skip

    # ---------------------------------------------------------------- one step
    def average(self, trainer: Trainer) -> None:
        """At the window's end, before clipping: each gradient the mean over the live groups."""
        if trainer.fit_loop._should_accumulate():
            return
        module = trainer.lightning_module
        quorum = self.manager._quorum_id  # the groups changed: each of them checks, at this step
        if self._checked_quorum != quorum and _same_weights(self.manager, module, self.config.group):
            self._checked_quorum = quorum
        grads = [local_tensor(p.grad) for p in module.parameters() if p.grad is not None]
        for bucket in _buckets(grads):
            flat = torch.cat([g.reshape(-1) for g in bucket])
            self.manager.allreduce(flat).wait()
            for g, part in zip(bucket, flat.split([g.numel() for g in bucket])):
                g.copy_(part.view_as(g))

    def _gated(self, step: Callable[..., Any]) -> Callable[..., Any]:
        def committed_step(closure: Optional[Callable[[], Any]] = None, **kwargs: Any) -> Any:
            if not self._quorum_open:
                self._meet()
            self._quorum_open = False
            loss = closure() if closure is not None else None
            # a peer of the group may still be in its average, which may take the whole timeout before it fails
            self._committed = self.manager.should_commit(timeout=timedelta(seconds=2 * self.config.timeout))
            if self._committed:
                step(**kwargs)
                self._uncommitted = 0
            else:
                _take_back_the_step(self._trainer)
                self._uncommitted += 1
                _check_uncommitted(self._uncommitted, self.config)
            return loss

        return committed_step

    def _if_committed(self, step: Callable[..., Any], stepwise: set[int]) -> Callable[..., Any]:
        def scheduler_step(scheduler: Any, metric: Any) -> Any:
            return step(scheduler, metric) if self._committed or id(scheduler) not in stepwise else None

        return scheduler_step

    def close(self) -> None:
        if self._trainer is not None:  # once: a validate after the fit tears down again
            self._undo_leave()
            self.manager.shutdown(wait=False)
            self._trainer = None


class _Snapshot(Callback):
    """Lightning's state after each window's last batch, which a healing group receives."""

    def __init__(self, replicas: Replicas) -> None:
        self.replicas = replicas

    def on_train_batch_end(self, trainer: Trainer, *args: Any) -> None:
        if not trainer.fit_loop._should_accumulate():
            self.replicas.snapshot(trainer)


def join(config: Optional[FaultTolerance], rank: int, world: int, device: torch.device) -> Alone:
    """This rank's Manager, meeting its group in the attempt's own store; the lighthouse checked first."""
    if config is None:
        return Alone()
    from torchft import Manager
    from torchft.checkpointing.http_transport import HTTPTransport
    from torchft.process_group import ProcessGroupGloo, ProcessGroupNCCL

    lighthouse = _reachable(config)
    timeout = timedelta(seconds=config.timeout)
    host, port = store_address()

    class _WeightsOnly(HTTPTransport):
        """torchft's HTTP transfer of a live group's state, read with ``weights_only=True``: nothing received runs."""

        @classmethod
        def _load_from_address(cls, address: str, timeout: timedelta) -> object:
            from torch.distributed._serialization import _streaming_load

            with urllib.request.urlopen(address, timeout=timeout.total_seconds()) as f:
                return _streaming_load(f, weights_only=True)

    pg = ProcessGroupNCCL(timeout=timeout) if device.type == "cuda" else ProcessGroupGloo(timeout=timeout)
    manager = Manager(
        pg=pg, load_state_dict=None, state_dict=None, min_replica_size=config.min_groups, use_async_quorum=False,
        timeout=timeout, quorum_timeout=timedelta(seconds=config.quorum_timeout),
        connect_timeout=timedelta(seconds=config.connect_timeout), rank=rank, world_size=world,
        store_addr=host, store_port=port, lighthouse_addr=lighthouse, replica_id=f"group_{config.group}",
        hostname=config.hostname or socket.gethostname(), init_sync=False,
        checkpoint_transport=_WeightsOnly(timeout=timeout, num_chunks=0),
    )  # fmt: skip
    return Replicas(manager, config)


def _reachable(config: FaultTolerance) -> str:
    """The lighthouse's address, answering within ``connect_timeout`` (on every rank: none waits on another)."""
    address = config.lighthouse or os.environ.get("TORCHFT_LIGHTHOUSE")
    if not address:
        raise PipelineConfigError(
            "fault_tolerance without a lighthouse: give fault_tolerance={'lighthouse': 'http://host:port', ...} or"
            " set TORCHFT_LIGHTHOUSE (start one with: torchft_lighthouse --bind [::]:29510 --min_replicas 1)."
        )
    where = urlparse(address)
    deadline = time.monotonic() + config.connect_timeout
    while True:
        try:
            socket.create_connection((where.hostname, where.port), timeout=1.0).close()
            return address
        except OSError as error:
            if time.monotonic() > deadline:
                raise PipelineConfigError(
                    f"The torchft lighthouse at {address} did not answer within {config.connect_timeout:g} s"
                    f" ({error}). Start it first (torchft_lighthouse --bind [::]:{where.port} --min_replicas 1),"
                    " or give fault_tolerance the address it serves."
                ) from None
            time.sleep(0.2)


def _check_trainer(trainer: Trainer) -> None:
    module = trainer.lightning_module
    if not module.automatic_optimization:
        raise PipelineConfigError(
            "fault_tolerance with manual optimization (automatic_optimization=False): the step's commit is decided"
            " around Lightning's optimizer step. Use automatic optimization with fault_tolerance."
        )
    if grad_scaler(trainer.precision_plugin) is not None:
        raise PipelineConfigError(
            f"fault_tolerance with precision={trainer.precision!r}: the loss scaler would move on steps that do not"
            " commit, and a healing group does not receive it. Use precision='bf16-mixed' or '32-true'."
        )


def _same_weights(manager: Any, module: torch.nn.Module, group: int) -> bool:
    """Whether every live group's rank in this position holds the same weights as this one (False: not known, the
    average failed), at the first step of each new set of groups, where all of them check. Groups that start
    together heal from none: a group seeded differently would average its gradients into other weights,
    silently. Two 16-bit halves of a CRC-32 and their squares, summed exactly."""
    from torch.distributed import ReduceOp

    crc = 0
    for name, tensor in module.state_dict().items():
        crc = zlib.crc32(name.encode() + local_tensor(tensor).detach().cpu().contiguous().view(-1).view(torch.uint8)
                         .numpy().tobytes(), crc)  # fmt: skip
    device = next((local_tensor(p).device for p in module.parameters()), torch.device("cpu"))  # NCCL: on the GPU
    mine = torch.tensor([crc & 0xFFFF, crc >> 16], dtype=torch.float64, device=device)
    mine = torch.cat([mine, mine * mine])
    summed = mine.clone()
    manager.allreduce(summed, reduce_op=ReduceOp.SUM).wait()
    if manager.errored() is not None:
        return False
    if not torch.equal(summed, mine * manager.num_participants()):
        raise PipelineConfigError(
            f"Replica group {group} holds other weights than the live groups at its first step (this rank's stage):"
            " they started from different initialisations. Seed every group alike (seed_everything with the same"
            " seed) or build the model from the same weights (init_weights)."
        )
    return True


def _check_uncommitted(count: int, config: FaultTolerance) -> None:
    if count > config.max_uncommitted:
        raise RuntimeError(
            f"{count} steps in a row did not commit (more than fault_tolerance max_uncommitted="
            f"{config.max_uncommitted}): fewer than min_groups={config.min_groups} groups are live, or their averages"
            " keep failing, and each such step drops its batch. Start the lighthouse with --min_replicas"
            f" {config.min_groups} so that groups wait for each other, or check the other groups' logs."
        )


def _take_back_the_step(trainer: Optional[Trainer]) -> None:
    """Lightning counts an optimizer step whether or not it stepped: not a step that did not commit."""
    assert trainer is not None
    progress = trainer.fit_loop.epoch_loop.automatic_optimization.optim_progress.optimizer.step
    for part in (progress.total, progress.current):
        part.ready -= 1
        part.completed -= 1  # Lightning adds it back after the optimizer step returns


def _buckets(grads: list[torch.Tensor]) -> list[list[torch.Tensor]]:
    """Gradients of one dtype and device together, up to ``_BUCKET`` elements a call, in the module's order."""
    buckets: list[list[torch.Tensor]] = []
    size = 0
    for g in grads:
        last = buckets[-1] if buckets else None
        if last is None or size + g.numel() > _BUCKET or (last[0].dtype, last[0].device) != (g.dtype, g.device):
            buckets.append([g])
            size = g.numel()
        else:
            last.append(g)
            size += g.numel()
    return buckets
