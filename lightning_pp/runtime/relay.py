"""Carry what the last stage's user step logged (and its loss) to every rank, as one process would log it.

The user's step runs once per micro-batch on the last stage only. Its ``self.log`` calls are
recorded there, combined per name by ``reduce_fx`` into the value one process would log for the
whole batch, broadcast, and replayed through ``LightningModule.log`` on every rank, so the progress
bar and loggers on rank 0 and ``callback_metrics`` everywhere see the same numbers.
"""

from __future__ import annotations

import inspect
import pickle
import warnings
from dataclasses import dataclass, field
from typing import Any

import torch
import torch.distributed as dist
from lightning.pytorch import LightningModule

from lightning_pp.layout.mesh import Layout
from lightning_pp.split.microbatch import merge_microbatches
from lightning_pp.split.stage import get_path

_FIRST = 16384  # bytes of a report's first message: a step's loss and logs fit (a few hundred bytes each)
_LENGTH = 8  # bytes of each length at its start: the values' and the meaning's
_LOG_SIGNATURE = inspect.signature(LightningModule.log)
_REDUCTIONS: dict[Any, str] = {
    "mean": "mean", "avg": "mean", torch.mean: "mean",
    "sum": "sum", torch.sum: "sum", sum: "sum",
    "max": "max", torch.max: "max", max: "max",
    "min": "min", torch.min: "min", min: "min",
}  # fmt: skip


@dataclass
class LogRecord:
    name: str
    value: torch.Tensor
    options: dict[str, Any]
    weight: float
    metric: str | None = None  # dotted path of a logged torchmetrics object, replayed as that object


@dataclass
class StepReport:
    """What every rank needs from the last stage after a step."""

    loss: torch.Tensor | None
    logs: list[LogRecord]
    metric_states: dict[str, dict[str, Any]] = field(default_factory=dict)


def predictions_to_first_stage(outputs: dict[int, Any], rows: int, layout: Layout, rank: int) -> Any:
    """What the last stage's predict steps returned, joined over micro-batches of ``rows`` samples, on the
    pipeline's first stage (global rank 0 for the first pipeline); None elsewhere. Tensor-parallel shards hold the
    same predictions: only shard 0's pipelines hand theirs on."""
    if layout.tp_rank != 0:
        return None
    first, last = layout.first_stage_rank, layout.last_stage_rank
    box = [merge_microbatches([outputs[i] for i in sorted(outputs)], rows) if rank == last else None]
    if first != last and rank == last:
        dist.send_object_list(box, dst=first)
    elif first != last and rank == first:
        dist.recv_object_list(box, src=last)
    return box[0] if rank == first else None


def quiet_sync_advice() -> None:
    """Lightning advises ``self.log(..., sync_dist=True)`` for epoch-level values whenever the run is distributed;
    with one pipeline (no replicas) every rank already logs the pipeline's exact value, and syncing would do
    nothing. A process-wide filter for that one message."""
    warnings.filterwarnings("ignore", message=r"It is recommended to use `self\.log\(.*sync_dist=True\)`")


def reduction_of(reduce_fx: Any, name: str) -> str:
    key = reduce_fx.lower() if isinstance(reduce_fx, str) else reduce_fx
    try:
        return _REDUCTIONS[key]
    except (KeyError, TypeError):
        raise ValueError(
            f"self.log({name!r}, ..., reduce_fx={reduce_fx!r}): under the pipeline a step's value is combined over"
            " micro-batches, which works for reduce_fx 'mean', 'sum', 'max' or 'min'."
        ) from None


class LogRecorder:
    """Stands in for ``LightningModule.log`` while the user's step runs on one micro-batch."""

    def __init__(self, metric_paths: dict[int, str] | None = None) -> None:
        self.records: list[LogRecord] = []
        self.weight = 1.0
        self._metric_paths = metric_paths or {}

    def __call__(self, *args: Any, **kwargs: Any) -> None:
        bound = _LOG_SIGNATURE.bind(None, *args, **kwargs)
        bound.apply_defaults()
        options = {k: v for k, v in bound.arguments.items() if k not in ("self", "name", "value")}
        name, value = bound.arguments["name"], bound.arguments["value"]
        if id(value) in self._metric_paths:
            self.records.append(LogRecord(name, torch.zeros(()), options, self.weight, self._metric_paths[id(value)]))
            return
        if not isinstance(value, (torch.Tensor, int, float, bool)):
            raise TypeError(
                f"self.log({name!r}, {type(value).__name__}): under the pipeline, log tensors, numbers or"
                " torchmetrics objects that are attributes of the LightningModule."
            )
        reduction_of(options["reduce_fx"], name)
        tensor = value.detach().clone() if isinstance(value, torch.Tensor) else torch.tensor(float(value))
        weight = float(options["batch_size"]) if options["batch_size"] is not None else self.weight
        options["sync_dist_group"] = None  # process groups do not travel; replay reduces over the default group
        self.records.append(LogRecord(name, tensor, options, weight))


def combine(records: list[LogRecord]) -> list[LogRecord]:
    """One record per name: what a single process would log for the whole batch."""
    by_name: dict[str, list[LogRecord]] = {}
    for record in records:
        by_name.setdefault(record.name, []).append(record)
    combined = []
    for name, group in by_name.items():
        if group[-1].metric is not None:
            combined.append(group[-1])  # the metric's own state makes its value; see metrics.py
            continue
        kind = reduction_of(group[0].options["reduce_fx"], name)
        device = group[0].value.device  # the user's step logs on the stage's device; numbers arrive on the CPU
        values = torch.stack([r.value.float().reshape(()).to(device) for r in group])
        weights = torch.tensor([r.weight for r in group], dtype=values.dtype, device=device)
        if kind == "mean":
            value = (values * weights).sum() / weights.sum() if len(group) > 1 else values[0]
        elif kind == "sum":
            value = values.sum()
        elif kind == "max":
            value = values.max()
        else:
            value = values.min()
        options = dict(group[0].options)
        if options["batch_size"] is not None:
            options["batch_size"] = int(sum(r.weight for r in group))
        combined.append(LogRecord(name, value.to(group[0].value.dtype), options, float(weights.sum())))
    return combined


@dataclass(frozen=True)
class _Meaning:
    """What a report's values are: it travels with the first report and again only when it changes (a new name, a
    batch_size that differs at an epoch's last batch, metric states, which travel whole each time they exist)."""

    loss: torch.dtype | None
    records: tuple[tuple[str, dict[str, Any], float, str | None, torch.dtype], ...]
    metric_states: dict[str, dict[str, Any]]

    @staticmethod
    def of(report: StepReport) -> _Meaning:
        records = tuple((r.name, r.options, r.weight, r.metric, r.value.dtype) for r in report.logs)
        return _Meaning(None if report.loss is None else report.loss.dtype, records, report.metric_states)

    def report(self, values: torch.Tensor) -> StepReport:
        """The report whose values (float64, on the device they came on) this meaning gives."""
        first = 0 if self.loss is None else 1
        loss = None if self.loss is None else values[0].to(self.loss)
        logs = [LogRecord(name, values[first + i].to(dtype), options, weight, metric)
                for i, (name, options, weight, metric, dtype) in enumerate(self.records)]  # fmt: skip
        return StepReport(loss, logs, self.metric_states)


class ReportRelay:
    """Hands the last stage's report to the other ranks of its pipeline without making it wait, or read its device.

    A broadcast would hold the last stage until the first stage finished its last backward; under
    1F1B that puts the last stage's optimizer step on the critical path of every step (about 3% of
    step time here). The last stage posts sends instead and goes on; the others receive what is
    usually there already. Sends of one step complete before the next step's are posted.

    A report is its values (the loss and each logged value, one float64 each: exact for every float and for
    integers below 2**53) and their meaning (names, options, dtypes: pickled, sent only when it changes). On the
    CPU both go as one message of ``_FIRST`` bytes that starts with their lengths (a size sent ahead cost the
    receiver a second receive, 0.4 ms a step on a CPU rank), a larger one sends the rest after it. Where the
    pipeline's group is NCCL (``host_group`` given, gloo), the values stay on the device, sent as one tensor over
    the pipeline's group, and only the lengths and a changed meaning cross the host: neither side reads a device
    value to the host (a synchronisation) in a step that logs nothing new.
    """

    _TAG = 7351  # apart from the schedule's P2P traffic on the same group

    def __init__(
        self,
        src: int,
        ranks: list[int],
        group: dist.ProcessGroup | None,
        device: torch.device,
        host_group: dist.ProcessGroup | None = None,
    ) -> None:
        self.src = src
        self.others = [r for r in ranks if r != src]
        self.group = group
        self.device = device
        self.host_group = host_group
        # where the lengths and the meaning travel: the host's group under NCCL, else the values' own
        self._head = (torch.device("cpu"), host_group) if host_group is not None else (device, group)
        self._pending: list[Any] = []
        self._buffers: tuple[torch.Tensor, ...] = ()
        self._meaning: _Meaning | None = None  # the last one sent, or received

    def relay(self, report: StepReport | None) -> StepReport:
        """Every rank of the pipeline leaves with the last stage's report (``src`` is a global rank)."""
        if dist.get_rank() == self.src:
            assert report is not None
            self.flush()
            self._send(report)
            return report
        return self._receive()

    def _send(self, report: StepReport) -> None:
        meaning = _Meaning.of(report)
        told = b"" if not meaning.metric_states and meaning == self._meaning else pickle.dumps(meaning)
        self._meaning = meaning
        parts = ([] if report.loss is None else [report.loss]) + [r.value for r in report.logs]
        values = torch.stack([v.detach().reshape(()).to(self.device, torch.float64) for v in parts]) if parts else None
        apart = self.host_group is not None and values is not None
        carried = b"" if values is None or apart else values.numpy().tobytes()
        head = len(carried).to_bytes(_LENGTH, "little") + len(told).to_bytes(_LENGTH, "little")
        payload = head + carried + told
        first = bytearray(_FIRST)
        first[: min(len(payload), _FIRST)] = payload[:_FIRST]
        host, head_group = self._head
        buffers = [
            (torch.frombuffer(part, dtype=torch.uint8).to(host), head_group)
            for part in (first, bytearray(payload[_FIRST:]))
            if part
        ]
        if apart:
            buffers.append((values, self.group))
        self._buffers = tuple(buffer for buffer, _ in buffers)
        for dst in self.others:
            for buffer, group in buffers:
                self._pending.append(dist.isend(buffer, dst, group=group, tag=self._TAG))

    def _receive(self) -> StepReport:
        host, group = self._head
        first = torch.empty(_FIRST, dtype=torch.uint8, device=host)
        dist.recv(first, self.src, group=group, tag=self._TAG)
        payload = first.cpu().numpy().tobytes()
        carried = int.from_bytes(payload[:_LENGTH], "little")
        told = int.from_bytes(payload[_LENGTH : 2 * _LENGTH], "little")
        length = 2 * _LENGTH + carried + told
        if length > _FIRST:  # a report larger than the first message (many logs, metric states)
            rest = torch.empty(length - _FIRST, dtype=torch.uint8, device=host)
            dist.recv(rest, self.src, group=group, tag=self._TAG)
            payload += rest.cpu().numpy().tobytes()
        if told:
            self._meaning = pickle.loads(payload[2 * _LENGTH + carried : length])
        meaning = self._meaning
        assert meaning is not None
        n = len(meaning.records) + (meaning.loss is not None)
        if not n:
            values = torch.empty(0, dtype=torch.float64)
        elif carried:
            values = torch.frombuffer(bytearray(payload[2 * _LENGTH : 2 * _LENGTH + carried]), dtype=torch.float64)
        else:  # on the device, over the pipeline's own group: nothing read to the host
            values = torch.empty(n, dtype=torch.float64, device=self.device)
            dist.recv(values, self.src, group=self.group, tag=self._TAG)
        return meaning.report(values)

    def flush(self) -> None:
        """Wait for the sends posted so far (before posting more, and before the process group goes)."""
        for work in self._pending:
            work.wait()
        self._pending, self._buffers = [], ()


def replay(module: LightningModule, records: list[LogRecord], device: torch.device) -> None:
    """Log the combined values through Lightning, once per name, on this rank."""
    for record in records:
        value = get_path(module, record.metric) if record.metric else record.value.to(device)
        module.log(record.name, value, **record.options)
