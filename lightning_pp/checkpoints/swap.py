"""The checkpoint at a path is always a complete one, whatever moment a process dies during a save.

Every rank writes into a sibling ``.<name>.partial`` (the same directory, so the same filesystem, where a
rename is atomic, wherever the system's temporary directory is); once every rank has confirmed its part,
rank 0 moves it into place. A file replaces a file with one ``rename``. A directory (a sharded
checkpoint) cannot replace a directory with one ``rename``: on Linux ``renameat2(RENAME_EXCHANGE)``
swaps the two atomically, and the old one, now at the partial name, is deleted. Where that is not
available (another OS, a filesystem without it) the old one is first moved aside to ``.<name>.old``,
which leaves a moment with nothing at the path: a load that finds nothing there takes the newest
complete checkpoint such an interrupted swap left (the new one if it was complete, else the old one)
and says so, and the next save puts it back in place before cleaning up. Leftovers never accumulate:
each save starts by removing the previous save's.
"""

from __future__ import annotations

import contextlib
import ctypes
import os
import shutil
import signal
from collections.abc import Callable, Iterator
from pathlib import Path

# Deterministic faults for tests: "<rank>:<n>:<point>" kills that rank at ``point`` of its n-th save
# (``<rank>:<n>`` alone: at "written"). Points, in order: start, torn (the part half-written), staged (an
# async_save's write under way), written, swapped (between the two renames, or after the exchange), landed (in
# place, before the cleanup).
FAULT_ENV = "LIGHTNING_PP_KILL_DURING_SAVE"
NO_EXCHANGE_ENV = "LIGHTNING_PP_NO_RENAME_EXCHANGE"  # "1": the fallback, as where renameat2 is missing
_saves = 0  # this process's saves so far, for FAULT_ENV


@contextlib.contextmanager
def swapped_in(
    path: Path, rank: int, barrier: Callable[[str], None], complete: Callable[[Path], bool]
) -> Iterator[Path]:
    """One save, on every rank: yields where to write this rank's part, then moves the whole into place."""
    partial = begin_save(path, rank, barrier, complete)
    yield partial
    finish_save(partial, path, rank, barrier)


def begin_save(path: Path, rank: int, barrier: Callable[[str], None], complete: Callable[[Path], bool]) -> Path:
    """Where every rank writes its part of the save to ``path``. Rank 0 first puts back what an interrupted save
    left aside and clears leftovers, before any rank writes."""
    global _saves
    _saves += 1
    if rank == 0:
        _prepare(path, complete)
    barrier("save_checkpoint_start")
    fault_point(rank, "start")
    return _partial_path(path)


def finish_save(
    partial: Path, path: Path, rank: int, barrier: Callable[[str], None], last: Callable[[], None] | None = None
) -> None:
    """Once every rank has written its part (``barrier``), rank 0 completes it (``last``) and swaps it in."""
    fault_point(rank, "written")
    barrier("save_checkpoint")
    if rank == 0:
        if last is not None:
            last()
        _replace_atomically(partial, path, rank)


def fault_point(rank: int, point: str, tear: Path | None = None) -> None:
    """Die here if ``FAULT_ENV`` asks for it; at "torn", cut ``tear`` (a file) to half its size first."""
    spec = os.environ.get(FAULT_ENV, "").split(":")
    if len(spec) < 2 or (int(spec[0]), int(spec[1]), spec[2] if len(spec) > 2 else "written") != (rank, _saves, point):
        return
    if tear is not None and tear.is_file():
        os.truncate(tear, tear.stat().st_size // 2)
    os.kill(os.getpid(), signal.SIGKILL)


def _partial_path(path: Path) -> Path:
    """Where a checkpoint is written before every rank has confirmed its part."""
    return path.with_name(f".{path.name}.partial")


def _old_path(path: Path) -> Path:
    return path.with_name(f".{path.name}.old")


def _prepare(path: Path, complete: Callable[[Path], bool]) -> None:
    """Put back a checkpoint an interrupted swap left aside, then remove every leftover of earlier saves."""
    found, _ = recover(path, complete)
    if found != path:
        os.replace(found, path)
    for leftover in (_partial_path(path), _old_path(path)):
        _remove(leftover)


def _replace_atomically(partial: Path, path: Path, rank: int) -> None:
    """Move a finished checkpoint (file or directory) into place; an existing one stays until then."""
    if path.exists() and (partial.is_dir() or path.is_dir()):  # one rename cannot replace a directory
        if partial.is_dir() and path.is_dir() and _exchange(partial, path):  # the old one is now at the partial name
            fault_point(rank, "swapped")
            fault_point(rank, "landed")
            _remove(partial)
            return
        old = _old_path(path)  # removed by _prepare, before any rank wrote
        os.replace(path, old)
        fault_point(rank, "swapped")
        os.replace(partial, path)
        fault_point(rank, "landed")
        _remove(old)
        return
    os.replace(partial, path)
    fault_point(rank, "landed")


def recover(path: Path, complete: Callable[[Path], bool]) -> tuple[Path, str | None]:
    """``path``, or where an interrupted swap left the newest complete checkpoint, and a message saying so."""
    if path.exists():
        return path, None
    for candidate, what in ((_partial_path(path), "the new checkpoint"), (_old_path(path), "the previous checkpoint")):
        if candidate.exists() and complete(candidate):
            return candidate, (
                f"{path} does not exist: a save was interrupted while swapping it in. Loading {what}, complete, from"
                f" {candidate}; the next save puts it back in place."
            )
    return path, None


def _exchange(a: Path, b: Path) -> bool:
    """Swap two paths atomically (Linux ``renameat2(RENAME_EXCHANGE)``); False where that is not available."""
    if os.environ.get(NO_EXCHANGE_ENV) == "1":
        return False
    renameat2 = getattr(ctypes.CDLL(None, use_errno=True), "renameat2", None)
    if renameat2 is None:
        return False
    at_fdcwd, rename_exchange = -100, 2
    if renameat2(at_fdcwd, os.fsencode(a), at_fdcwd, os.fsencode(b), rename_exchange) == 0:
        return True
    errno = ctypes.get_errno()
    if errno in (22, 38, 95):  # EINVAL, ENOSYS, EOPNOTSUPP: this filesystem or kernel cannot
        return False
    raise OSError(errno, os.strerror(errno), str(a), None, str(b))


def _remove(path: Path) -> None:
    if path.is_dir() and not path.is_symlink():
        shutil.rmtree(path)
    elif path.exists() or path.is_symlink():
        path.unlink()
