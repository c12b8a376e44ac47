"""A signal that reaches any rank stops every rank at the same step, and no step makes a collective to learn it.

Lightning carries a SIGTERM by a broadcast of rank 0's flag at the start of every training step and inside its
handler: a collective each step (a host sync on a GPU), and the news of rank 0 only. A SIGTERM to any other rank
(one node preempted) left that rank waiting at its exit while its peers waited on it in the schedule, for the
process group's whole timeout. Under the strategy the news travels through the job's store instead:

1. the handler notes the signal; a thread of the rank posts it in the store (the first request of a round wins);
2. every rank's thread looks for a request (one store read each ``_WATCH_S``) and, on seeing one, posts how many
   steps (training, validation, test or predict) its rank has begun; from then on the rank begins no step of its
   own accord;
3. at the start of each step a rank that knows of a request reads every rank's count (waiting only for peers'
   threads, never for a peer's step) and runs on until it has begun as many steps as the furthest rank.
   There every rank stops together (SIGTERM, SIGINT), or, at the next start of an accumulation window, saves
   SLURM's requeue checkpoint together and goes on.

Ranks that exchange a pipeline's activations are at most a step apart, and a rank behind can always finish the
steps the furthest one began: no rank is left in a receive from a rank that stopped, and a checkpoint saved on
the way out (``OnExceptionCheckpoint``, SLURM's) holds one step on every rank. The job then exits with status
128 + the signal's number (143 for SIGTERM, 130 for SIGINT), which restart policies and schedulers read as
"stopped by a signal", not Lightning's 0 ("finished").
"""

from __future__ import annotations

import contextlib
import logging
import os
import signal
import threading
import time
from dataclasses import dataclass
from datetime import timedelta
from types import FrameType
from typing import Any, Callable, Iterator

import torch.distributed as dist
from lightning.fabric.plugins.environments import SLURMEnvironment
from lightning.pytorch.trainer.connectors.signal_connector import _SignalConnector
from lightning.pytorch.trainer.states import TrainerStatus
from lightning.pytorch.utilities.exceptions import SIGTERMException
from lightning.pytorch.utilities.rank_zero import rank_prefixed_message, rank_zero_info
from torch.distributed.distributed_c10d import _get_default_store

log = logging.getLogger(__name__)
_KEYS = "lightning_pp/signal"
_WATCH_S = 0.5  # how often each rank's thread reads the store: a stop is known everywhere within about this
_COUNTS_WAIT = timedelta(seconds=60)  # for every rank's thread to post its count; only a dead rank does not
_STOP, _REQUEUE = "stop", "requeue"


class SignalStop(SIGTERMException):
    """Every rank stops at the same step because ``rank`` received ``signum``; the exit status is 128 + signum."""

    def __init__(self, signum: int, rank: int) -> None:
        super().__init__(128 + signum)
        self.signum, self.rank = signum, rank


@dataclass(frozen=True)
class _Request:
    kind: str
    signum: int
    rank: int

    def encode(self) -> str:
        return f"{self.kind} {self.signum} {self.rank}"

    @staticmethod
    def decode(text: bytes) -> _Request:
        kind, signum, rank = text.decode().split()
        return _Request(kind, int(signum), int(rank))


class StoreSignals(_SignalConnector):
    """Lightning's signal connector, with the news carried through the job's store (see the module's docstring).

    What Lightning does with a signal stays Lightning's: a stop raises its ``SIGTERMException`` (``on_exception``
    hooks, loggers finalised, launcher's processes ended), SLURM's requeue signal runs its requeue handler. Only
    where (the same step on every rank) and how the news travels change.
    """

    def __init__(self, trainer: Any) -> None:
        super().__init__(trainer)
        self._runs = 0
        self._watcher: _Watcher | None = None

    def register_signal_handlers(self) -> None:
        self.received_sigterm = False
        self._original_handlers = self._get_current_signal_handlers()
        self._runs += 1
        rank, world = self.trainer.global_rank, self.trainer.world_size
        self._watcher = _Watcher(_get_default_store(), f"{_KEYS}/{self._runs}", rank, world)
        kinds = {signal.SIGTERM: _STOP, signal.SIGINT: _STOP}
        environment = self.trainer._accelerator_connector.cluster_environment
        if isinstance(environment, SLURMEnvironment) and environment.auto_requeue:
            assert environment.requeue_signal is not None
            kinds[environment.requeue_signal] = _REQUEUE
        for signum, kind in kinds.items():
            self._register_signal(signum, _Handler(self._watcher, kind, signal.getsignal(signum)))
        # Lightning's own per-step broadcast of rank 0's flag, replaced by the step boundary below
        self.trainer.fit_loop.epoch_loop._broadcast_sigterm_tensor = self._at_step_start

    def _at_step_start(self) -> None:
        # where a requeue checkpoint resumes exactly: no gradient of an accumulation window left behind
        done = self.trainer.fit_loop.epoch_loop.batch_progress.current.ready
        self._at_boundary(requeue_here=done % self.trainer.accumulate_grad_batches == 0)

    def at_evaluation_step(self) -> None:
        """A validation, test or predict step begins: a stop acts here too (within a long validation, or a
        ``trainer.validate`` run); a requeue checkpoint waits for training."""
        self._at_boundary(requeue_here=False)

    def _at_boundary(self, requeue_here: bool) -> None:
        assert self._watcher is not None
        request = self._watcher.before_step(requeue_here)
        if request is None:
            return
        if request.kind == _REQUEUE:
            self._slurm_sigusr_handler_fn(request.signum, None)  # type: ignore[arg-type]
            return
        rank_zero_info(
            f"Rank {request.rank} received {signal.Signals(request.signum).name}: every rank stops after the same"
            f" {self._watcher.begun} steps of this run (exit status {128 + request.signum})."
        )
        self.received_sigterm = True
        raise SignalStop(request.signum, request.rank)

    def teardown(self) -> None:
        super().teardown()
        if self._watcher is not None:
            self._watcher.close()
            ended = self.trainer.state.status != TrainerStatus.INTERRUPTED
            if ended and self._watcher.stop_left():  # no step began after it: the run ended as planned, and says so
                self.received_sigterm = True
                message = "A stop signal came as the run ended: it completed."
                log.warning(rank_prefixed_message(message, self.trainer.global_rank))
        self.trainer.fit_loop.epoch_loop.__dict__.pop("_broadcast_sigterm_tensor", None)


class _Handler:
    """What runs on the signal: note it (the watcher's thread posts it); a second SIGINT is the user insisting."""

    def __init__(self, watcher: _Watcher, kind: str, previous: Any) -> None:
        self.watcher, self.kind = watcher, kind
        # a handler the user set before fit runs too, as under Lightning (not Python's KeyboardInterrupt)
        self.previous: Callable | None = (
            previous if callable(previous) and previous is not signal.default_int_handler else None
        )

    def __call__(self, signum: int, frame: FrameType | None) -> None:
        if signum == signal.SIGINT and self.watcher.noted(signum):
            raise KeyboardInterrupt
        self.watcher.note(_Request(self.kind, signum, self.watcher.rank))
        if self.previous is not None:
            self.previous(signum, frame)
        if self.kind == _STOP and _leaving:  # waiting on other replica groups: see stop_at_once
            _leaving[-1]()
            raise SignalStop(signum, self.watcher.rank)


class _Watcher:
    """This rank's side of the store protocol: a thread that posts and looks for requests, and the step boundary."""

    def __init__(self, store: dist.Store, keys: str, rank: int, world_size: int) -> None:
        self.store, self.keys, self.rank, self.world_size = store, keys, rank, world_size
        self.begun = 0
        self._round = 0
        self._request: _Request | None = None  # of this round, once this rank's thread posted its count
        self._target: int | None = None
        self._noted: list[_Request] = []
        self._seen: set[int] = set()
        self._lock = threading.Lock()
        self._wake, self._closing = threading.Event(), threading.Event()
        self._thread = threading.Thread(target=self._watch, name="lightning_pp-signals", daemon=True)
        self._thread.start()

    # ---------------------------------------------------------------- the signal handler's side
    def note(self, request: _Request) -> None:
        self._seen.add(request.signum)
        self._noted.append(request)
        self._wake.set()

    def noted(self, signum: int) -> bool:
        return signum in self._seen

    def stop_left(self) -> bool:
        """A stop this rank received or learnt of that no step boundary acted on."""
        request = self._request
        return any(r.kind == _STOP for r in self._noted) or (request is not None and request.kind == _STOP)

    # ---------------------------------------------------------------- the thread's side
    def _watch(self) -> None:
        posted = -1
        while not self._closing.is_set():
            self._wake.wait(_WATCH_S)
            self._wake.clear()
            try:
                with self._lock:
                    round_, known = self._round, self._request is not None
                if known or round_ == posted:
                    continue
                key = f"{self.keys}/{round_}/request"
                if self._noted:  # post this rank's own (what it returns is the round's request, whoever's won)
                    mine = self._noted[0]
                    request = _Request.decode(self.store.compare_set(key, "", mine.encode()))
                    if request == mine or request.kind == mine.kind:  # posted, or a peer's asks the same
                        self._noted.pop(0)
                elif self.store.check([key]):
                    request = _Request.decode(self.store.get(key))
                else:
                    continue
                with self._lock:
                    if self._round != round_:
                        continue
                    self._request, count = request, self.begun
                self.store.set(f"{self.keys}/{round_}/begun/{self.rank}", str(count))
                posted = round_
            except (dist.DistStoreError, dist.DistNetworkError, RuntimeError):
                return  # the store's host (rank 0) has gone: the job is ending, and the failure path says why

    def close(self) -> None:
        """The thread ends at once, unless a store call of its is in flight: waited for briefly (one returning while the
        interpreter shuts down would abort the process), not for long (one to a stopped host never returns)."""
        self._closing.set()
        self._wake.set()
        self._thread.join(_WATCH_S)

    # ---------------------------------------------------------------- the training loop's side
    def before_step(self, requeue_here: bool) -> _Request | None:
        """None to begin the next step; the round's request where every rank stops or saves together (a requeue
        checkpoint where ``requeue_here``: the ranks agree on it, being at the same step)."""
        with self._lock:
            request = self._request
            if request is None:
                self.begun += 1
                return None
        if self._target is None:
            self._target = max(self._counts())
            self.store.add(f"{self.keys}/{self._round}/read", 1)
        if self.begun < self._target or (request.kind == _REQUEUE and not requeue_here):
            self.begun += 1
            return None
        self._every_rank_read()
        with self._lock:
            self._round += 1
            self._request, self._target = None, None
            if request.kind != _STOP:
                self.begun += 1  # the step begins after the requeue checkpoint
        self._wake.set()
        return request

    def _every_rank_read(self) -> None:
        """No rank acts before every rank has read the counts (each does at its first step boundary after its thread
        posted, which a rank behind reaches without its peers), and rank 0, the store's host, acts (and exits) last
        of all: no peer's store call finds the store gone."""
        read, done = f"{self.keys}/{self._round}/read", f"{self.keys}/{self._round}/done"
        self._wait_for(read)
        self.store.add(done, 1)
        if self.rank == 0:
            self._wait_for(done)

    def _wait_for(self, key: str) -> None:
        deadline = time.monotonic() + _COUNTS_WAIT.total_seconds()
        while self.store.add(key, 0) < self.world_size:
            if time.monotonic() > deadline:
                raise RuntimeError(
                    f"Rank {self.rank} learnt of a signal, but not every rank reached a step boundary within"
                    f" {_COUNTS_WAIT.total_seconds():.0f} s to agree where to stop: a rank stopped or hangs. Look at"
                    " the other ranks' logs."
                )
            time.sleep(0.01)

    def _counts(self) -> list[int]:
        keys = [f"{self.keys}/{self._round}/begun/{r}" for r in range(self.world_size)]
        try:
            self.store.wait(keys, _COUNTS_WAIT)
        except dist.DistStoreError:
            silent = [r for r, key in enumerate(keys) if not self.store.check([key])]
            raise RuntimeError(
                f"Rank {self.rank} learnt of a signal, but ranks {silent} did not say within"
                f" {_COUNTS_WAIT.total_seconds():.0f} s how far they had trained: they died or stopped. Look at their"
                " logs; a launcher with restarts (torchrun --max-restarts) starts the job again."
            ) from None
        return [int(count) for count in self.store.multi_get(keys)]


_leaving: list[Callable[[], None]] = []  # set while this rank waits on other replica groups (stop_at_once)


@contextlib.contextmanager
def stop_at_once(leave: Callable[[], None]) -> Iterator[None]:
    """While the rank waits for its replica group to meet the others (torchft's quorum), a stop signal ends the
    wait at once: ``leave`` (the group leaves the lighthouse), then ``SignalStop``. The rank may be waiting on a
    peer of its group that is gone, and every other group waits on this group's heartbeat meanwhile: a stop at
    the step's end would come only after the quorum's timeout, the whole of it a stall for the live groups."""
    _leaving.append(leave)
    try:
        yield
    finally:
        _leaving.pop()


def leave_at_a_stop_signal(leave: Callable[[], None]) -> Callable[[], None]:
    """Call ``leave`` (from a thread) as soon as a stop signal reaches this process, even while the main thread is
    blocked in a collective that the signal's handler must wait for; returns the undo.

    A rank of a replica group whose peer died waits in a receive until the process-group timeout, and meanwhile its
    group's manager tells the lighthouse the group is alive: the other groups cannot meet without it. The launcher
    sends the rank SIGTERM at once (torchrun, srun); Python runs the handler only when the receive returns, but the
    signal's number reaches the wakeup file descriptor at once, and a thread reading it has the group leave.
    Needs the main thread (``signal.set_wakeup_fd``)."""
    read, write = os.pipe()
    os.set_blocking(write, False)
    previous = signal.set_wakeup_fd(write, warn_on_full_buffer=False)
    stops = {int(signal.SIGTERM), int(signal.SIGINT)}

    def watch() -> None:
        while data := os.read(read, 64):
            if stops & set(data):
                leave()
                return

    threading.Thread(target=watch, name="lightning_pp-leave-at-signal", daemon=True).start()

    def undo() -> None:
        signal.set_wakeup_fd(previous)
        os.close(write)  # the thread's read ends

    return undo


def at_evaluation_step(trainer: Any) -> None:
    """Called as each validation, test or predict step begins (see ``StoreSignals.at_evaluation_step``)."""
    if isinstance(trainer._signal_connector, StoreSignals):
        trainer._signal_connector.at_evaluation_step()


def carry_signals_through_store(trainer: Any) -> None:
    """Give ``trainer`` the store-carried signal connector (a job of one rank keeps Lightning's own: no broadcast)."""
    if trainer.world_size > 1 and not isinstance(trainer._signal_connector, StoreSignals):
        if not hasattr(trainer.fit_loop.epoch_loop, "_broadcast_sigterm_tensor"):
            raise RuntimeError(
                "This Lightning release has no per-step SIGTERM broadcast for the strategy to replace; lightning_pp"
                " supports lightning>=2.6,<2.7 (see pyproject.toml)."
            )
        trainer._signal_connector = StoreSignals(trainer)
