"""``async_save=True``: a sharded save that training does not wait for.

Each rank stages a copy of its shard and ``torch.distributed.checkpoint.async_save`` writes it in a
thread while training goes on; the write's own collectives (DCP's plan and metadata) run over a gloo
group of their own, so they never interleave with the pipeline's. The save is completed in the main
thread, on every rank, by the next save or at the end of fit: each rank waits for its write, all
meet at a barrier, and rank 0 moves the meta file into place and swaps the directory in
(``swap.finish_save``). So at most one save is in flight, and a checkpoint is complete, and ``last``,
only once every rank has written it: a rank killed during a write loses that save alone, the previous
checkpoint stays. Outside a running fit (``trainer.save_checkpoint`` after it) saves are synchronous.
"""

from __future__ import annotations

import os
from collections.abc import Callable
from concurrent.futures import Future
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist
from lightning.pytorch.trainer.states import TrainerFn, TrainerStatus
from torch.distributed.checkpoint import FileSystemWriter

from lightning_pp.checkpoints.formats import META_FILE, is_complete, save_sharded, split_sharded
from lightning_pp.checkpoints.integrity import sharded_writer, write_records
from lightning_pp.checkpoints.swap import begin_save, fault_point, finish_save, swapped_in
from lightning_pp.compat import stager_kept_between_saves

_STAGED_META = f"{META_FILE}.staged"  # written at the save, moved to META_FILE when every rank's write is done


@dataclass
class _InFlight:
    path: Path
    partial: Path
    write: Future | None  # None on a rank that writes nothing (a replica other than the first)
    writer: FileSystemWriter | None


class ShardedSaves:
    """A rank's sharded saves: synchronous, or (``background``) one at a time in flight."""

    def __init__(self, background: bool, checksums: bool = True) -> None:
        self.background, self.checksums = background, checksums
        self._group: dist.ProcessGroup | None = None
        self._stager: Any = None
        self._in_flight: _InFlight | None = None

    def save(
        self,
        checkpoint: dict[str, Any],
        path: str | os.PathLike,
        rank: int,
        barrier: Callable[[str], None],
        group: dist.ProcessGroup | None,
        writers: list[int] | None,
        trainer: Any,
    ) -> None:
        """Every rank calls it. ``writers``: the global ranks that write shards (None: every rank), over ``group``
        (None: the world). In the background only while ``trainer`` fits (whose end completes the save)."""
        path = Path(path)
        self.complete(rank, barrier)
        writes = writers is None or rank in writers
        running = trainer.state.fn == TrainerFn.FITTING and trainer.state.status == TrainerStatus.RUNNING
        if not (self.background and running):
            with swapped_in(path, rank, barrier, is_complete) as partial:
                if writes:
                    save_sharded(checkpoint, partial, rank, group, self.checksums)
            return
        from torch.distributed.checkpoint import async_save
        from torch.distributed.checkpoint.staging import DefaultStager, StagingOptions

        if self._group is None:  # every rank creates it, at its first background save
            self._group = dist.new_group(writers, backend="gloo")
        if self._stager is None:
            # one stager for a fit's saves: it keeps its copies and refills them, where a new one per save
            # allocates the whole shard again (page faults: 1.3 s of the 300 MB stage here); pinned for CUDA
            options = StagingOptions(torch.cuda.is_available(), False, False, False)
            self._stager = stager_kept_between_saves(DefaultStager(options))
        partial = begin_save(path, rank, barrier, is_complete)
        write, writer = None, None
        if writes:
            shards, rest = split_sharded(checkpoint)
            writer = sharded_writer(partial, self.checksums)  # its records taken in the writer's thread
            write = async_save(shards, storage_writer=writer, process_group=self._group, async_stager=self._stager)
            if rank == 0:  # the directory may not exist yet: the writer makes it in its thread
                partial.mkdir(parents=True, exist_ok=True)
                torch.save(rest, partial / _STAGED_META)
            fault_point(rank, "staged")
        self._in_flight = _InFlight(path, partial, write, writer)

    def complete(self, rank: int, barrier: Callable[[str], None], end: bool = False) -> None:
        """The save in flight, if any, lands (every rank, in the main thread); at the ``end`` of fit the staging
        copies are let go."""
        flight, self._in_flight = self._in_flight, None
        if flight is not None:
            if flight.write is not None:
                flight.write.result()

            def move_meta() -> None:
                assert flight.writer is not None  # rank 0 writes
                write_records(flight.partial, flight.writer, flight.partial / _STAGED_META)
                os.replace(flight.partial / _STAGED_META, flight.partial / META_FILE)

            finish_save(flight.partial, flight.path, rank, barrier, last=move_meta)
        if end and self._stager is not None:
            self._stager.close()
            self._stager = None
