"""A damaged checkpoint is refused by name, before any tensor is read.

DCP keeps no checksums, and a copy cut short, a disk error or a shard from another save reads back as wrong
numbers or a late error. So each rank, as it writes its shards (in the writer's thread under ``async_save``),
records each file's size and CRC-32; the records travel with DCP's own write results to the coordinator, which
adds ``.metadata`` and ``meta.pt`` and writes them to ``checksums.json`` (plain JSON). A full ``.ckpt`` needs no
record: ``torch.save``'s zip keeps a CRC-32 per entry.

At a resume every rank checks every size (one ``stat`` each) and the checksums of its share of the files (file i
on rank i mod world), posts what it found in the job's store and reads the others', so every rank refuses alike,
naming each file with what was expected and what was found, and the newest earlier checkpoint beside it that
checks. A sharded checkpoint written before the records still loads: the sizes its ``.metadata`` implies are
checked, and that is said once.
"""

from __future__ import annotations

import json
import mmap
import os
import threading
import zipfile
import zlib
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist
from lightning.pytorch.utilities.rank_zero import rank_zero_warn
from torch.distributed.checkpoint import FileSystemWriter
from torch.distributed.checkpoint.filesystem import DEFAULT_SUFFIX
from torch.distributed.checkpoint.metadata import Metadata, MetadataIndex
from torch.distributed.checkpoint.storage import WriteResult
from torch.futures import Future

from lightning_pp.checkpoints.trust import SafeReader
from lightning_pp.errors import DamagedCheckpointError, PipelineConfigError, UntrustedCheckpointError

META_FILE = "meta.pt"  # a sharded checkpoint's non-tensor entries, written last
RECORD_FILE = "checksums.json"
_METADATA = ".metadata"
_CARRIER = MetadataIndex("lightning_pp.checksums")  # a write result that carries a rank's records, not a tensor
_BLOCK = 4 * 2**20  # bytes per checksum: the writer is at most about one block ahead of its checksums
_rounds = 0  # this process's checks so far: the store keys of each one


def file_record(path: Path, block: int = _BLOCK) -> dict[str, Any]:
    """A file's size and the CRC-32 of each of its blocks, read through a memory map (no copy) and checksummed in
    parallel by this rank's threads (zlib releases the GIL)."""
    size = path.stat().st_size
    if size == 0:
        return {"size": 0, "block": block, "crc32": []}
    with open(path, "rb") as stream, mmap.mmap(stream.fileno(), 0, access=mmap.ACCESS_READ) as mapped:
        view = memoryview(mapped)
        try:
            starts = range(0, size, block)
            with ThreadPoolExecutor(max(1, min(len(starts), torch.get_num_threads()))) as pool:
                crcs = list(pool.map(lambda start: zlib.crc32(view[start : start + block]), starts))
        finally:
            view.release()
    return {"size": size, "block": block, "crc32": crcs}


class RecordingWriter(FileSystemWriter):
    """DCP's file writer that records each file's size and checksums: ``records`` on the coordinator after the save.

    A thread checksums each block of the rank's file as soon as the write has passed it, so the checksums cost
    the save only its last block where the rank has a core to spare (DCP writes a file front to back, once)."""

    records: dict[str, dict[str, Any]] | None = None

    def write_data(self, plan: Any, planner: Any) -> Future:
        tail = _Tail(Path(self.path) / f"{plan.storage_data.prefix}0{DEFAULT_SUFFIX}")  # this rank's one file
        tail.start()
        try:
            results = super().write_data(plan, planner).wait()
        finally:
            tail.done.set()
            tail.join()
        files = sorted({r.storage_data.relative_path for r in results})
        own = {name: tail.record if tail.path.name == name and tail.record else file_record(Path(self.path) / name)
               for name in files}  # fmt: skip
        future: Future = Future()
        future.set_result([*results, WriteResult(index=_CARRIER, size_in_bytes=0, storage_data=own)])
        return future

    def finish(self, metadata: Metadata, results: list[list[WriteResult]]) -> None:
        records: dict[str, dict[str, int]] = {}
        for carried in (r.storage_data for rank_results in results for r in rank_results if r.index == _CARRIER):
            records.update(carried)
        super().finish(metadata, [[r for r in rank_results if r.index != _CARRIER] for rank_results in results])
        records[_METADATA] = file_record(Path(self.path) / _METADATA)
        self.records = records


class _Tail(threading.Thread):
    """Checksums of a file being written, block by block behind the writer; ``record`` once ``done`` is set."""

    def __init__(self, path: Path, block: int = _BLOCK) -> None:
        super().__init__(daemon=True)
        self.path, self.block, self.done = path, block, threading.Event()
        self.record: dict[str, Any] | None = None

    def run(self) -> None:
        crcs: list[int] = []
        buffer = bytearray(self.block)
        offset, stream = 0, None
        try:
            while True:
                finished = self.done.is_set()  # before the size: a size read after it is the file's last
                if stream is None and self.path.exists():
                    stream = open(self.path, "rb")
                size = os.fstat(stream.fileno()).st_size if stream is not None else 0
                while stream is not None and (offset + self.block <= size or (finished and offset < size)):
                    n = os.preadv(stream.fileno(), [buffer], offset)
                    crcs.append(zlib.crc32(memoryview(buffer)[:n]))
                    offset += n
                if finished:
                    break
                self.done.wait(0.01)
        finally:
            if stream is not None:
                stream.close()
        self.record = {"size": offset, "block": self.block, "crc32": crcs}


def sharded_writer(path: Path, checksums: bool) -> FileSystemWriter:
    """DCP's writer of a sharded save: recording each file's size and checksums, or (``checksums=False``) not."""
    return RecordingWriter(path) if checksums else FileSystemWriter(path)


def write_records(directory: Path, writer: FileSystemWriter, meta: Path) -> None:
    """On the coordinator, after the save: ``checksums.json`` of a sharded directory, the shards' and
    ``.metadata``'s records and ``meta`` (the meta file, perhaps still under its staged name: recorded as
    ``META_FILE``). Nothing for a writer that did not record."""
    if not isinstance(writer, RecordingWriter):
        return
    assert writer.records is not None  # global rank 0 is the writers' coordinator
    files = {**writer.records, META_FILE: file_record(meta)}
    (directory / RECORD_FILE).write_text(json.dumps({"algorithm": "crc32", "files": files}, sort_keys=True))


def check_checkpoint(path: Path, every_rank: bool = False) -> None:
    """Refuse ``path`` (a sharded directory, or a ``torch.save`` file) if any of its files is not as written,
    before reading a tensor. ``every_rank``: every rank of the job calls it at once (a resume) and checks its share;
    else this process checks every file itself (``consolidate``, the exports, on one rank or none)."""
    together = every_rank and dist.is_available() and dist.is_initialized()
    world = dist.get_world_size() if together else 1
    rank = dist.get_rank() if world > 1 else 0
    found, note = _problems(path, rank, world)
    if world > 1:
        found = _everyone(found, rank, world)
    if note:
        rank_zero_warn(note)
    if found:
        earlier = _earlier_good(path)
        raise DamagedCheckpointError(
            f"The checkpoint {path} is damaged; nothing was loaded:\n  " + "\n  ".join(found) + "\n"
            + (f"The newest earlier checkpoint beside it that checks: {earlier}" if earlier else
               "No earlier checkpoint beside it checks.")
        )  # fmt: skip


def _problems(path: Path, rank: int, world: int) -> tuple[list[str], str | None]:
    """What is wrong with ``path`` (sizes: every file; checksums: this rank's share), and a note to say once."""
    if not path.exists():
        return [f"{path}: missing"], None
    if not path.is_dir():
        return _zip_problems(path, rank, world), None
    record = path / RECORD_FILE
    if not record.exists():
        return _implied_size_problems(path), (
            f"{path} was written without checksums (checksums=False, or before lightning-pp recorded them): only the"
            " sizes its .metadata implies are checked."
        )
    try:
        files = json.loads(record.read_text())["files"]
    except (ValueError, KeyError, TypeError) as error:
        return [f"{record}: unreadable ({error})"], None
    problems = []
    for i, (name, expected) in enumerate(sorted(files.items())):
        file = path / name
        if not file.is_file():
            problems.append(f"{file}: missing (expected {expected['size']} bytes)")
        elif file.stat().st_size != expected["size"]:
            problems.append(f"{file}: {file.stat().st_size} bytes, expected {expected['size']}")
        elif i % world == rank and (bad := _changed_blocks(file, expected)):
            problems.append(f"{file}: {bad} (changed since the save)")
    return problems, None


def _changed_blocks(file: Path, expected: dict[str, Any]) -> str:
    """Where ``file`` differs from its record (the first differing block: its bytes, the checksums found and
    recorded; how many more), or ''."""
    block = expected["block"]
    found = file_record(file, block)["crc32"]
    bad = [i for i, (a, b) in enumerate(zip(found, expected["crc32"])) if a != b]
    if not bad:
        return ""
    first = bad[0]
    more = f"; {len(bad) - 1} more blocks of {block} bytes differ" if len(bad) > 1 else ""
    return (f"bytes {first * block}-{min((first + 1) * block, expected['size'])} have CRC-32 {found[first]:08x},"
            f" the save recorded {expected['crc32'][first]:08x}{more}")  # fmt: skip


def _implied_size_problems(path: Path) -> list[str]:
    """A sharded checkpoint without records: each file at least as long as the entries ``.metadata`` places in it."""
    if not (path / _METADATA).is_file():
        return [f"{path / _METADATA}: missing"]
    if not (path / META_FILE).is_file():
        return [f"{path / META_FILE}: missing"]
    try:
        storage = SafeReader(path).read_metadata().storage_data
    except UntrustedCheckpointError:
        raise
    except PipelineConfigError as error:  # unreadable: damaged
        return [str(error)]
    ends: dict[str, int] = {}
    for info in storage.values():
        ends[info.relative_path] = max(ends.get(info.relative_path, 0), info.offset + info.length)
    problems = []
    for name, end in sorted(ends.items()):
        file = path / name
        size = file.stat().st_size if file.is_file() else None
        if size is None or size < end:
            problems.append(f"{file}: {'missing' if size is None else f'{size} bytes'}, expected at least {end}")
    return problems


def _zip_problems(path: Path, rank: int, world: int) -> list[str]:
    """A ``torch.save`` file: whole (its directory at the end) and its entries' CRC-32s (this rank's share)."""
    try:
        with zipfile.ZipFile(path) as archive:
            for i, info in enumerate(archive.infolist()):
                if i % world != rank or info.CRC == 0:  # 0: saved without checksums (torch's compute_crc32 off)
                    continue
                with archive.open(info) as entry:
                    while entry.read(_BLOCK):
                        pass
    except zipfile.BadZipFile as error:
        cut = "its end is missing (a copy cut short?)" if "not a zip file" in str(error) else str(error)
        return [f"{path}: not the file torch.save wrote: {cut}"]
    except (OSError, EOFError) as error:
        return [f"{path}: {error}"]
    return []


def _everyone(mine: list[str], rank: int, world: int) -> list[str]:
    """Every rank's findings, through the job's store (no collective: a rank that found damage does not block)."""
    global _rounds
    _rounds += 1
    store = dist.distributed_c10d._get_default_store()
    prefix = f"lightning_pp/checked/{_rounds}"
    store.set(f"{prefix}/{rank}", json.dumps(mine))
    keys = [f"{prefix}/{r}" for r in range(world)]
    store.wait(keys)
    found = [p for key in keys for p in json.loads(store.get(key))]
    return list(dict.fromkeys(found))


def _earlier_good(path: Path) -> Path | None:
    """The newest checkpoint beside ``path``, older than it, that checks whole (every file, in this process)."""
    parent = path.parent
    if not parent.is_dir():
        return None
    mine = path.stat().st_mtime if path.exists() else float("inf")
    candidates = [
        p for p in parent.iterdir()
        if p != path and not p.name.startswith(".") and (p.suffix == ".ckpt" or (p / META_FILE).is_file())
    ]  # fmt: skip
    for candidate in sorted(candidates, key=lambda p: p.stat().st_mtime, reverse=True):
        if candidate.stat().st_mtime <= mine and not _problems(candidate, 0, 1)[0]:
            return candidate
    return None
