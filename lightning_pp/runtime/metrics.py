"""torchmetrics objects updated by the user's step on the last stage, mirrored on every rank.

The step runs once per micro-batch, so a metric's ``forward`` would leave the last micro-batch's
value behind, and only the last stage would hold the accumulated state. After each step the last
stage computes the batch value one process would have seen and sends every updated metric's state
to all ranks; each rank's copy then logs and computes exactly as on one process (epoch values and
``on_*_epoch_end`` hooks included).
"""

from __future__ import annotations

import contextlib
from collections.abc import Iterator
from typing import Any

import torch
import torch.distributed as dist
from torch import nn
from torchmetrics import Metric

from lightning_pp.split.stage import get_path, patched


def _never_distributed() -> bool:
    return False


def find_metrics(module: nn.Module) -> dict[str, Metric]:
    return {name: m for name, m in module.named_modules() if isinstance(m, Metric)}


def sync_metrics_over(module: nn.Module, replicas: dist.ProcessGroup | None) -> None:
    """Sync ``compute`` over the pipeline replicas only: within a replica every rank holds the same state.

    A world-wide sync would count a replica's state once per stage; with one replica there is nothing to sync.
    """
    for metric in find_metrics(module).values():
        if replicas is None:
            metric.distributed_available_fn = _never_distributed
        else:
            metric.process_group = replicas


class MetricTap:
    """Records the calls one step makes to each metric of the module."""

    def __init__(self, module: nn.Module) -> None:
        self.metrics = find_metrics(module)
        self.paths = {id(m): name for name, m in self.metrics.items()}
        self.calls: dict[str, list[tuple[tuple, dict]]] = {}
        self.forwarded: set[str] = set()

    @contextlib.contextmanager
    def recording(self) -> Iterator[None]:
        self.calls, self.forwarded = {}, set()
        with contextlib.ExitStack() as stack:
            for name, metric in self.metrics.items():
                stack.enter_context(patched(metric, **self._spies(name, metric)))
            yield

    def _spies(self, name: str, metric: Metric) -> dict[str, Any]:
        update, inside_forward = metric.update, [False]

        def spy_forward(*args: Any, **kwargs: Any) -> Any:
            self.calls.setdefault(name, []).append((args, kwargs))
            self.forwarded.add(name)
            inside_forward[0] = True
            try:
                return type(metric).forward(metric, *args, **kwargs)
            finally:
                inside_forward[0] = False

        def spy_update(*args: Any, **kwargs: Any) -> Any:
            if not inside_forward[0]:
                self.calls.setdefault(name, []).append((args, kwargs))
            return update(*args, **kwargs)

        return {"forward": spy_forward, "update": spy_update}

    def states(self) -> dict[str, dict[str, Any]]:
        """State of every metric the step updated; a forward's cache holds the whole batch's value."""
        out = {}
        for name, calls in self.calls.items():
            metric = self.metrics[name]
            if name in self.forwarded:
                with patched(metric, process_group=None):  # a process group cannot be copied; the batch value is local
                    batch = metric.clone()
                batch.distributed_available_fn = _never_distributed
                batch.reset()
                for args, kwargs in calls:
                    batch.update(*args, **kwargs)
                metric._forward_cache = batch.compute()
            out[name] = {
                "state": {k: _detach(v) for k, v in metric.metric_state.items()},
                "forward_cache": _detach(metric._forward_cache),
                "update_count": metric._update_count,
            }
        return out


def load_states(module: nn.Module, states: dict[str, dict[str, Any]], device: torch.device) -> None:
    """Give this rank's metrics the last stage's state."""
    for name, saved in states.items():
        metric: Metric = get_path(module, name)
        for key, value in saved["state"].items():
            setattr(metric, key, _to(value, device))
        metric._forward_cache = _to(saved["forward_cache"], device)
        metric._update_count = saved["update_count"]
        metric._computed = None


def _detach(value: Any) -> Any:
    if isinstance(value, torch.Tensor):
        return value.detach().cpu()
    if isinstance(value, list):
        return [_detach(v) for v in value]
    return value


def _to(value: Any, device: torch.device) -> Any:
    if isinstance(value, torch.Tensor):
        return value.to(device)
    if isinstance(value, list):
        return [_to(v, device) for v in value]
    return value
