"""Opening a checkpoint runs no code it carries.

A pickle can call any function while it is read, and checkpoints travel (shared between teams, downloaded,
copied off a cluster). torch's answer, ``torch.load(weights_only=True)`` (its default since 2.6), covers the files
``torch.save`` wrote; ``torch.distributed.checkpoint`` reads its own ``.metadata`` with plain ``pickle.load`` and
every non-tensor value of a shard with ``torch.load(weights_only=False)``. So every door here goes through one of
three readers: :func:`load_file` (``torch.load`` with the user's ``weights_only``, torch's default when None), a
storage reader whose ``.metadata`` unpickler admits only DCP's metadata classes, and a load planner whose
non-tensor values load as ``weights_only`` says. ``weights_only=False`` (``consolidate --trust``) opens a
checkpoint one trusts that holds one's own objects, as with Lightning and torch.
"""

from __future__ import annotations

import pathlib
import pickle
from collections import OrderedDict
from pathlib import Path
from typing import Any

import torch
from torch.distributed.checkpoint import FileSystemReader
from torch.distributed.checkpoint import metadata as dcp_metadata
from torch.distributed.checkpoint.default_planner import DefaultLoadPlanner, _EmptyStateDictLoadPlanner
from torch.distributed.checkpoint.filesystem import _StorageInfo
from torch.distributed.checkpoint.metadata import Metadata, StorageMeta

from lightning_pp.errors import PipelineConfigError, UntrustedCheckpointError

TRUST_HINT = (
    "If you trust this checkpoint and its objects are your own, load it with weights_only=False"
    " (trainer.fit(..., ckpt_path=..., weights_only=False); python -m lightning_pp.consolidate --trust)."
)


def load_file(path: Path, weights_only: bool | None, mmap: bool = False) -> Any:
    """``torch.load`` of a checkpoint file on the CPU, refusing (by file and type) what ``weights_only`` refuses."""
    try:
        return torch.load(path, mmap=mmap, map_location="cpu", weights_only=weights_only)
    except pickle.UnpicklingError as error:
        if weights_only is False:
            raise
        raise UntrustedCheckpointError(
            f"{path} holds objects that loading it would have to run code for: {_unsafe_globals(path)}. Nothing"
            f" was loaded. {TRUST_HINT}"
        ) from error


def _unsafe_globals(path: Path) -> str:
    """The types (classes, functions) a file's pickle names that ``weights_only`` does not admit, read statically."""
    try:
        names = torch.serialization.get_unsafe_globals_in_checkpoint(path)
    except Exception:  # not a torch.save zip: torch's own message says what it found
        names = []
    return ", ".join(sorted(names)) or "(see the error above)"


# DCP's ``.metadata``: the classes its writer pickles (every class of its metadata module, its storage info, dtypes
# and the like below), nothing callable beyond building them
_METADATA_MODULE = dcp_metadata.__name__
_NAMED: dict[tuple[str, str], Any] = {
    ("torch.distributed.checkpoint.filesystem", "_StorageInfo"): _StorageInfo,
    ("torch.serialization", "_get_layout"): torch.serialization._get_layout,  # a layout by its name
    ("torch", "Size"): torch.Size,
    ("builtins", "set"): set,
    ("builtins", "frozenset"): frozenset,
    ("collections", "OrderedDict"): OrderedDict,
    **{("pathlib", n): getattr(pathlib, n) for n in ("Path", "PosixPath", "WindowsPath", "PurePath", "PurePosixPath",
                                                     "PureWindowsPath")},
}  # fmt: skip


class _MetadataUnpickler(pickle.Unpickler):
    def __init__(self, file: Any, name: Path) -> None:
        super().__init__(file)
        self._name = name

    def find_class(self, module: str, name: str) -> Any:
        found = _admitted(module, name)
        if found is None:
            raise UntrustedCheckpointError(
                f"{self._name} names {module}.{name}, which is not one of torch.distributed.checkpoint's metadata"
                f" types: reading it would run code it carries. Nothing was loaded. {TRUST_HINT}"
            )
        return found


def _admitted(module: str, name: str) -> Any:
    """The class or value the metadata may name, or None."""
    if module == _METADATA_MODULE:
        found = getattr(dcp_metadata, name, None)
        return found if isinstance(found, type) and found.__module__ == module else None
    if module == "torch" and isinstance(found := getattr(torch, name, None), (torch.dtype, torch.layout,
                                                                                torch.memory_format)):
        return found
    return _NAMED.get((module, name))


class SafeReader(FileSystemReader):
    """DCP's file reader whose ``.metadata`` admits only DCP's metadata types (``trust``: any, as DCP reads it)."""

    def __init__(self, path: str | Path, trust: bool = False) -> None:
        super().__init__(path)
        self._trust = trust

    def read_metadata(self, *args: Any, **kwargs: Any) -> Metadata:
        if self._trust:
            return super().read_metadata(*args, **kwargs)
        path = Path(self._get_metadata_path(kwargs.get("rank")))
        with open(path, "rb") as stream:
            try:
                metadata = _MetadataUnpickler(stream, path).load()
            except (pickle.UnpicklingError, EOFError, AttributeError, TypeError, ValueError) as error:
                if isinstance(error, UntrustedCheckpointError):
                    raise
                raise PipelineConfigError(f"{path} cannot be read ({error}): the file is damaged.") from error
        if not isinstance(metadata, Metadata):
            raise PipelineConfigError(f"{path} holds a {type(metadata).__name__}, not DCP's metadata.")
        if getattr(metadata, "storage_meta", None) is None:
            metadata.storage_meta = StorageMeta()
        metadata.storage_meta.load_id = self.load_id
        return metadata


class _SafeBytes:
    """A planner's non-tensor values loaded as ``weights_only`` says (DCP's own: ``weights_only=False``): checked
    with torch's weights-only unpickler first, so DCP's load that follows runs nothing it did not admit."""

    def __init__(self, source: Path, weights_only: bool | None = None, **kwargs: Any) -> None:
        super().__init__(**kwargs)
        self._source, self._weights_only = source, weights_only

    def load_bytes(self, read_item: Any, value: Any) -> None:
        if self._weights_only is not False:
            try:
                torch.load(value, weights_only=True)
            except pickle.UnpicklingError as error:
                found = str(error).split("GLOBAL ")[-1].split(" ")[0] if "GLOBAL " in str(error) else "an object"
                raise UntrustedCheckpointError(
                    f"{self._source} holds, as {read_item.dest_index.fqn!r}, {found}: loading it would run code it"
                    f" carries. Nothing was loaded. {TRUST_HINT}"
                ) from error
            value.seek(0)
        super().load_bytes(read_item, value)  # type: ignore[misc]


class SafeLoadPlanner(_SafeBytes, DefaultLoadPlanner):
    """DCP's planner for a given state dict."""


class SafeEmptyPlanner(_SafeBytes, _EmptyStateDictLoadPlanner):
    """DCP's planner that reads a whole checkpoint into an empty dict."""


def read_dcp(
    state: dict[str, Any], path: Path, weights_only: bool | None, whole: bool = False, reader: Any = None
) -> None:
    """DCP's load of ``state`` from ``path`` in this process (``whole``: every entry, into the empty ``state``),
    through the readers above (or ``reader``, for another format); a refusal raised as itself, not inside DCP's
    ``CheckpointException``."""
    from torch.distributed.checkpoint.api import CheckpointException
    from torch.distributed.checkpoint.state_dict_loader import _load_state_dict, load

    if reader is None:
        reader = SafeReader(path, trust=weights_only is False)
        reader.read_metadata()  # a refusal as itself: DCP folds what this raises into a message of its own
    planner = (SafeEmptyPlanner if whole else SafeLoadPlanner)(path, weights_only)
    try:
        (_load_state_dict if whole else load)(state, storage_reader=reader, planner=planner, no_dist=True)
    except CheckpointException as error:
        for failure, _ in error.failures.values():
            if isinstance(failure, PipelineConfigError):
                raise failure from None
        raise
