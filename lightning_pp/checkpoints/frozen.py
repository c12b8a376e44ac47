"""Checkpoints without the frozen base: what ``init_weights`` gave and training never changed is read from there again.

A fine-tune of a large pretrained model (LoRA: a few million adapter parameters on a frozen base of billions)
changes a small part of its weights, and a checkpoint that holds the base rewrites all of it at every save (140 GB
for a 70B base). A parameter that ``init_weights`` set, that was frozen (``requires_grad=False``) from the first
batch to the save and that no optimizer holds state for still equals the pretrained file's tensor: the checkpoint
leaves it out and records where it came from (the path, and each weight file's name, size and modification time:
a ``stat``, no tensor read) and which keys it left out. Resuming reads those keys from ``init_weights`` again,
each rank its own tensors as the first fit does, then the rest from the checkpoint; a base that is gone, changed,
not given or given at another path is refused on every rank when the checkpoint is opened.

Kept in the checkpoint: every buffer (running statistics change without gradients; buffers are small), a frozen
parameter the module initialised itself (nothing could read it again), a parameter that trained at some point of
the run, a base read from an earlier checkpoint rather than from ``init_weights``, and everything under
``save_frozen=True``.
"""

from __future__ import annotations

import os
import time
from collections.abc import Iterable, Mapping
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist
from torch import nn

from lightning_pp.checkpoints.pretrained import WeightMap
from lightning_pp.errors import PipelineConfigError

FROZEN_KEY = "lightning_pp_frozen_base"  # the checkpoint entry: {"init_weights", "fingerprint", "left_out"}
# the files a pretrained checkpoint's tensors are read from (safetensors and their index, DCP, torch files)
_WEIGHT_FILES = (".safetensors", ".index.json", ".metadata", ".distcp", ".pt", ".pth", ".bin", ".ckpt")

Fingerprint = dict[str, list[int]]  # file name -> [size, modification time in ns]


def fingerprint(path: Path) -> Fingerprint:
    """Each weight file's name, size and modification time: a changed or rewritten file shows, nothing is read."""
    files = [path] if path.is_file() else sorted(f for f in path.iterdir() if f.is_file() and _weights(f.name))
    return {f.name: [(s := f.stat()).st_size, s.st_mtime_ns] for f in files}


def _weights(name: str) -> bool:
    return name.endswith(_WEIGHT_FILES)


@dataclass
class FrozenBase:
    """What this rank read from ``init_weights`` (at the first batch, or again at a resume) and left frozen since."""

    path: Path
    fingerprint: Fingerprint  # taken when it was read
    names: frozenset[str]  # this rank's parameters (every name of a tied one) that equal the file's tensors

    def still_frozen(self, module: nn.Module, optimizers: Iterable[torch.optim.Optimizer]) -> frozenset[str]:
        """``names`` less any parameter trainable now or with optimizer state (it trained): those stay in the
        checkpoint from this save on."""
        trained = {id(p) for o in optimizers for p, state in o.state.items() if state}
        self.names = frozenset(
            n
            for n, p in module.named_parameters(remove_duplicate=False)
            if n in self.names and not p.requires_grad and id(p) not in trained
        )
        return self.names

    def record(self, left_out: list[str]) -> dict[str, Any]:
        """The checkpoint's entry: where the base is, what it looked like when read, and the keys left out."""
        return {"init_weights": str(self.path), "fingerprint": self.fingerprint, "left_out": left_out}


def read_base(path: Path, module: nn.Module, weights: WeightMap) -> FrozenBase:
    """The base about to be read into ``module`` (this rank's stages): its fingerprint and frozen names."""
    frozen = {n for n, p in module.named_parameters(remove_duplicate=False) if not p.requires_grad}
    return FrozenBase(path.resolve(), fingerprint(path), frozenset(frozen & set(weights.keys)))


def gather_left_out(names: frozenset[str], group: dist.ProcessGroup | None) -> list[str]:
    """Every pipeline rank's left-out names, on every rank of ``group`` (each rank holds its own stages)."""
    if not dist.is_initialized():
        return sorted(names)
    parts: list[Any] = [None] * dist.get_world_size(group)
    dist.all_gather_object(parts, sorted(names), group=group)
    return sorted({n for part in parts for n in part})


def check_base(record: Mapping[str, Any] | None, init_weights: str | os.PathLike | None, ckpt: Path) -> frozenset[str]:
    """The keys the checkpoint at ``ckpt`` left out (none without a ``record``), once the base they are read from
    is there as it was saved: the same ``init_weights`` path, the same files. Every rank checks alike, at load."""
    if not record:
        return frozenset()
    recorded, left_out = Path(record["init_weights"]), record["left_out"]
    what = f"The checkpoint {ckpt} leaves out {len(left_out)} frozen tensors read from init_weights={str(recorded)!r}"
    fix = (
        f" Resume with PipelineStrategy(init_weights={str(recorded)!r}) holding the files it was saved with, or from"
        " a checkpoint saved with PipelineStrategy(save_frozen=True), which keeps them."
    )
    if init_weights is None:
        raise PipelineConfigError(f"{what}, and this run gives no init_weights.{fix}")
    given = Path(init_weights).expanduser().resolve()
    if given != recorded:
        raise PipelineConfigError(f"{what}, but this run gives init_weights={str(given)!r}.{fix}")
    if not recorded.exists():
        raise PipelineConfigError(f"{what}, and nothing exists at that path any more.{fix}")
    changes = _changes(record["fingerprint"], fingerprint(recorded))
    if changes:
        raise PipelineConfigError(f"{what}, and its files changed since: {'; '.join(changes)}.{fix}")
    return frozenset(left_out)


def _changes(saved: Fingerprint, now: Fingerprint) -> list[str]:
    """What differs between two fingerprints, file by file."""
    changes = [f"{name} is gone" for name in saved if name not in now]
    changes += [f"{name} is new" for name in now if name not in saved]
    for name in (n for n in saved if n in now and list(saved[n]) != list(now[n])):
        (size, mtime), (size_now, mtime_now) = saved[name], now[name]
        changes.append(
            f"{name} has {size_now} bytes, was {size}"
            if size != size_now
            else f"{name} was rewritten at {_when(mtime_now)} (dated {_when(mtime)} when the run read it)"
        )
    return changes


def _when(ns: int) -> str:
    return time.strftime("%Y-%m-%d %H:%M:%S", time.localtime(ns / 1e9))


def left_out_weights(weights: WeightMap, left_out: frozenset[str], ckpt: Path) -> WeightMap:
    """The part of ``init_weights``' map a resumed checkpoint needs: the keys it left out. Refused, naming them,
    where this run's ``init_weights`` does not provide one of them (another ``init_weights_keys``)."""
    missing = sorted(left_out - set(weights.keys))
    if missing:
        raise PipelineConfigError(
            f"The checkpoint {ckpt} leaves out {len(missing)} frozen tensors that this run's init_weights does not"
            f" provide: {', '.join(missing[:5])}{' ...' if len(missing) > 5 else ''}. Resume with the init_weights"
            " and init_weights_keys of the run that saved it."
        )
    return WeightMap({n: k for n, k in weights.keys.items() if n in left_out}, weights.left, weights.prefix)
