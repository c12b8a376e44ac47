"""A save killed at any moment leaves a complete checkpoint at its path (or, where the swap of a directory
cannot be atomic, beside it, which loading finds and says so); the next save leaves no leftovers."""

from __future__ import annotations

import os
import shutil
import signal
from pathlib import Path

import pytest
import torch

import lightning_pp.checkpoints.swap as swap
from lightning_pp.checkpoints.formats import META_FILE, is_complete
from lightning_pp.checkpoints.swap import FAULT_ENV, NO_EXCHANGE_ENV, fault_point, recover, swapped_in

POINTS = ["start", "torn", "written", "swapped", "landed"]


def save(path: Path, version: int, sharded: bool) -> None:
    """One save as the strategy makes it (one rank)."""
    with swapped_in(path, 0, lambda _: None, is_complete) as partial:
        if sharded:
            partial.mkdir()
            torch.save({"v": version}, partial / "__0_0.distcp")
            fault_point(0, "torn")
            torch.save({"v": version}, partial / META_FILE)  # written last: marks the directory complete
        else:
            torch.save({"v": version}, partial)
            fault_point(0, "torn", tear=partial)


def version(path: Path) -> int:
    return torch.load(path / META_FILE if path.is_dir() else path)["v"]


def bases(tmp_path: Path) -> list[Path]:
    """The test's directory, and a tmpfs (another filesystem than /tmp) where there is one."""
    shm = Path("/dev/shm")
    return [tmp_path] + ([Path(os.path.realpath(shm))] if shm.is_dir() and os.access(shm, os.W_OK) else [])


@pytest.mark.parametrize(
    "sharded,exchange", [(True, True), (True, False), (False, False)], ids=["sharded", "sharded-two-renames", "full"]
)
def test_a_save_killed_at_any_point_leaves_a_complete_checkpoint(tmp_path, sharded, exchange):
    for base in bases(tmp_path):
        for point in POINTS if sharded else [p for p in POINTS if p != "swapped"]:  # a file moves in one rename
            root = base / f"lpp-swap-{os.getpid()}-{sharded}-{exchange}-{point}"
            root.mkdir()
            path = root / "last.ckpt"
            pid = os.fork()
            if pid == 0:  # the saving process: its first save finishes, its second dies at `point`
                swap._saves = 0
                os.environ[FAULT_ENV], os.environ[NO_EXCHANGE_ENV] = f"0:2:{point}", "0" if exchange else "1"
                save(path, 1, sharded)
                save(path, 2, sharded)
                os._exit(0)
            _, status = os.waitpid(pid, 0)
            assert os.WIFSIGNALED(status) and os.WTERMSIG(status) == signal.SIGKILL, (point, status)
            found, message = recover(path, is_complete)
            # the last save that finished, or the one the kill cut short once it was complete
            assert version(found) == (2 if point in ("swapped", "landed") else 1), (base, point)
            assert (message is not None) == (found != path)
            assert found == path or (sharded and not exchange and point == "swapped"), (base, point, found)
            os.environ[NO_EXCHANGE_ENV] = "0" if exchange else "1"
            try:
                save(path, 3, sharded)  # the next save puts things back and leaves nothing behind
            finally:
                del os.environ[NO_EXCHANGE_ENV]
            assert version(path) == 3 and sorted(p.name for p in root.iterdir()) == ["last.ckpt"], point
            if base != tmp_path:
                shutil.rmtree(root)


def test_a_save_in_the_other_format_replaces_the_checkpoint(tmp_path):
    path = tmp_path / "last.ckpt"
    save(path, 1, sharded=False)
    save(path, 2, sharded=True)  # a directory over a file
    assert path.is_dir() and version(path) == 2
    save(path, 3, sharded=False)  # and back
    assert path.is_file() and version(path) == 3 and [p.name for p in tmp_path.iterdir()] == ["last.ckpt"]
