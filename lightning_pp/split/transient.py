"""What a backward pass holds beyond the activations saved for it, per segment: the planner's peak memory.

A stage's peak comes during one of its backwards: its saved activations, and on top of them the gradients the
backward computes (to its inputs and through its intermediates, its weights' gradients, which past a step's first
micro-batch exist beside ``.grad`` until they are added in), less the saved activations it has freed by then. For
most layers that is about their weights' gradients; for a vocabulary head it is the logits' gradient beside the head's
weight gradient (8 GiB for 2 x 4096 tokens at Llama 3's 128256): the largest single term of a language model's last
stage, which the saved bytes alone leave out.
"""

from __future__ import annotations

import weakref
from typing import Any

import torch
from torch.utils._python_dispatch import TorchDispatchMode
from torch.utils._pytree import tree_flatten


class BackwardBytes(TorchDispatchMode):
    """Entered around a backward pass: per segment, the most bytes held at once beyond those live when the backward
    reached the segment, net of the saved activations (``watch``) it has freed by then: the storages the backward
    makes, from the operation that makes them until they are freed (outputs that share an input's storage, views
    and in-place results, are not new). The backward starts in the last segment (the loss); ``reached(i)`` marks
    where it moves on (the gradient of segment ``i``'s output is complete). Net, as a device's allocator counts:
    against CUDA's peak over the backward on an H200 (``benchmarks/transient_cuda.py``) a vocabulary head's counted
    0.98-1.00 of it either way, an encoder layer's 0.47-1.00 net but 0.97-3.1x gross."""

    def __init__(self, n_segments: int) -> None:
        super().__init__()
        self.peaks = [0] * n_segments
        self._segment = n_segments - 1
        self._live: dict[int, int] = {}  # storage -> bytes, for storages the backward made that are still alive
        self._held = self._base = 0
        self._running = False

    def watch(self, storage: torch.UntypedStorage) -> None:
        """A storage saved for the backward: what the backward frees of it lowers what it holds."""
        weakref.finalize(storage, self._released, storage.nbytes())

    def __enter__(self) -> BackwardBytes:
        self._running = True
        return super().__enter__()

    def __exit__(self, *exc: Any) -> None:
        self._running = False
        super().__exit__(*exc)

    def reached(self, segment: int) -> None:
        if segment < self._segment:
            self._segment, self._base = segment, self._held

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):  # type: ignore[no-untyped-def]
        out = func(*args, **(kwargs or {}))
        given = {_key(t) for t in tree_flatten((args, kwargs))[0] if _has_storage(t)}
        for t in tree_flatten(out)[0]:
            if _has_storage(t) and _key(t) not in given and _key(t) not in self._live:
                self._count(t.untyped_storage())
        return out

    def _count(self, storage: torch.UntypedStorage) -> None:
        key, size = storage._cdata, storage.nbytes()
        self._live[key] = size
        self._held += size
        weakref.finalize(storage, self._freed, key)
        self.peaks[self._segment] = max(self.peaks[self._segment], self._held - self._base)

    def _freed(self, key: int) -> None:
        self._held -= self._live.pop(key, 0)

    def _released(self, size: int) -> None:
        if self._running:
            self._held -= size


def _has_storage(t: Any) -> bool:
    return isinstance(t, torch.Tensor) and torch._C._has_storage(t)


def _key(t: torch.Tensor) -> int:
    return t.untyped_storage()._cdata
