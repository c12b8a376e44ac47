"""The micro-batch lanes travelling the ring of stages: prefill, then one token per step, the last stage's
tokens sent to every rank of the pipeline.

Every rank walks the same timeline: lane ``m`` at step ``t`` is on stage ``s`` at ``t * P + m + s`` (``P`` the
larger of the lanes and the stages, so that a token is back at the first stage before its lane's next step),
the tokens of ``(t, m)`` reach the other ranks just after the last stage chose them. A rank does its part in
that order (its later-stage work first at a tie), sending without waiting and receiving when it needs a tensor,
so messages between any two ranks are received in the order they were sent (as NCCL needs) and no rank waits on
one that waits on it. With more lanes than stages every stage works on one lane while the others work on
others. A lane whose rows all ended (EOS) leaves the timeline on every rank at once: every rank reads its tokens.

Shapes travel with each prefill's hidden state (a fixed-size header), a decode step's are the prefill's with
one position: no receiver reuses a shape inferred for another length (a torch ``PipelineStage`` inferred once
returns the old shape silently).
"""

from __future__ import annotations

import time
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

import torch
import torch.distributed as dist

from lightning_pp.errors import PipelineConfigError
from lightning_pp.generation.sampling import Chooser, Sampling
from lightning_pp.generation.stages import StageCall

_DTYPES = [torch.float32, torch.bfloat16, torch.float16, torch.float64]
_HEADER = 9  # ndim, up to 5 sizes, dtype, status, the fingerprint of what the first stage's layers receive


@dataclass
class GenerationReport:
    """What one ``generate`` call did on this rank."""

    new_tokens: int = 0  # per row, the longest
    seconds: float = 0.0
    cache_bytes: dict[int, int] = field(default_factory=dict)  # per stage this rank holds, at the end


@dataclass
class Ring:
    """This rank's place in its pipeline for generation."""

    calls: dict[int, StageCall]  # the stages this rank holds
    n_stages: int
    rank_of: Callable[[int], int]  # the global rank holding a stage, in this pipeline
    rank: int
    group: Any
    device: torch.device  # where the stages compute
    wire: torch.device  # where messages travel from (the GPU under NCCL)


def generate(
    ring: Ring, input_ids: torch.Tensor, mask: torch.Tensor, sampling: Sampling
) -> tuple[torch.Tensor, GenerationReport]:
    """Every row's prompt and new tokens (finished rows padded), on every rank of the pipeline."""
    start = time.perf_counter()
    rows, length = input_ids.shape
    lanes = min(rows, sampling.microbatches or ring.n_stages)
    sizes = [len(c) for c in torch.arange(rows).tensor_split(lanes)]
    bounds = [slice(sum(sizes[:m]), sum(sizes[: m + 1])) for m in range(lanes)]
    walk = _Walk(ring, input_ids, mask, sampling, bounds)
    last = ring.n_stages - 1
    period = max(lanes, ring.n_stages)
    timeline = []
    for t in range(sampling.max_new_tokens):
        for m in range(lanes):
            for s in ring.calls:
                timeline.append((t * period + m + s, 0, -s, t, m, s))
            if ring.rank != ring.rank_of(last):
                timeline.append((t * period + m + last, 1, 0, t, m, None))
    for _, _, _, t, m, s in sorted(timeline):
        if walk.ended_before(m, t):
            continue
        if s is None:
            walk.receive_tokens(t, m)
        else:
            walk.compute(t, m, s)
    walk.settle()  # not after an error: the job stops with it, its receivers may never come
    ids = walk.sequences()
    report = GenerationReport(ids.shape[1] - length, time.perf_counter() - start)
    report.cache_bytes = {s: call.cache_bytes() for s, call in ring.calls.items()}
    for call in ring.calls.values():
        call.caches.clear()
    return ids, report


class _Walk:
    """One ``generate`` call's state on this rank: each lane's tokens, rows still going, messages in flight."""

    def __init__(
        self, ring: Ring, input_ids: torch.Tensor, mask: torch.Tensor, sampling: Sampling, bounds: list[slice]
    ) -> None:
        self.ring, self.sampling, self.bounds = ring, sampling, bounds
        self.input_ids, self.mask = input_ids, mask
        self.no_padding = bool((mask == 1).all())  # as generate: no mask at all then
        self.tokens: list[list[torch.Tensor]] = [[] for _ in bounds]
        self.going = [torch.ones(b.stop - b.start, dtype=torch.bool, device=input_ids.device) for b in bounds]
        self.ended: list[int | None] = [None for _ in bounds]  # the step after which a lane ended
        self.local: dict[tuple[int, int, int], tuple[torch.Tensor, torch.Tensor]] = {}  # stage -> next, same rank
        self.shapes: dict[tuple[int, int], tuple[list[int], torch.dtype]] = {}
        self.sent: list[Any] = []
        last = ring.n_stages - 1
        self.chooser = Chooser(sampling, input_ids.shape[0], ring.device) if last in ring.calls else None

    def ended_before(self, lane: int, step: int) -> bool:
        ended = self.ended[lane]
        return ended is not None and ended < step

    def compute(self, t: int, m: int, s: int) -> None:
        ring, rows = self.ring, self.bounds[m]
        call = ring.calls[s]
        ids = self.input_ids[rows] if t == 0 else self.tokens[m][t - 1][:, None]
        mask = self.mask[rows]
        if t:
            mask = torch.cat([mask, mask.new_ones(mask.shape[0], t)], dim=1)
        positions = (mask.long().cumsum(-1) - 1).masked_fill(mask == 0, 0)[:, -ids.shape[1] :]
        header = torch.zeros(_HEADER, dtype=torch.float64)
        received = None
        if s > 0:
            received, header = self._receive_hidden(t, m, s)
        out = call(m, ids, None if self.no_padding else mask, positions, received, record=t == 0)
        if t == 0:  # every stage's layers must receive what the first stage's do beside the hidden state
            if s == 0:
                header[8] = call.seen
            elif header[7] == 0 and not torch.isclose(call.seen, header[8], rtol=1e-5, atol=1e-6):
                header[7] = s
        if s < ring.n_stages - 1:
            self._send_hidden(t, m, s, out, header)
        else:
            self._choose(t, m, out, int(header[7]))

    def _receive_hidden(self, t: int, m: int, s: int) -> tuple[torch.Tensor, torch.Tensor]:
        ring = self.ring
        if s - 1 in ring.calls:
            return self.local.pop((t, m, s))
        source = ring.rank_of(s - 1)
        if t == 0:
            header = torch.zeros(_HEADER, dtype=torch.float64, device=ring.wire)
            dist.recv(header, src=source, group=ring.group)
            header = header.cpu()
            ndim = int(header[0])
            self.shapes[(m, s)] = ([int(d) for d in header[1 : 1 + ndim]], _DTYPES[int(header[6])])
        else:
            header = torch.zeros(_HEADER, dtype=torch.float64)
        shape, dtype = self.shapes[(m, s)]
        if t:
            shape = [shape[0], 1, *shape[2:]]
        hidden = torch.empty(shape, dtype=dtype, device=ring.wire)
        dist.recv(hidden, src=source, group=ring.group)
        return hidden.to(ring.device), header

    def _send_hidden(self, t: int, m: int, s: int, hidden: torch.Tensor, header: torch.Tensor) -> None:
        ring = self.ring
        if s + 1 in ring.calls:
            self.local[(t, m, s + 1)] = (hidden, header)
            return
        target = ring.rank_of(s + 1)
        if t == 0:
            if hidden.ndim < 2 or hidden.ndim > 5 or hidden.dtype not in _DTYPES:
                raise PipelineConfigError(
                    f"stage {s} hands on a {hidden.dtype} tensor of shape {tuple(hidden.shape)}; generate sends a"
                    " (rows, positions, ...) floating hidden state between stages."
                )
            header[0] = hidden.ndim
            header[1 : 1 + hidden.ndim] = torch.tensor(hidden.shape, dtype=torch.float64)
            header[6] = _DTYPES.index(hidden.dtype)
            self.sent.append(dist.isend(header.to(ring.wire), dst=target, group=ring.group))
        self.sent.append(dist.isend(hidden.to(ring.wire).contiguous(), dst=target, group=ring.group))

    def _choose(self, t: int, m: int, logits: torch.Tensor, status: int) -> None:
        assert self.chooser is not None
        tokens = self.chooser.choose(logits, self.bounds[m], t)
        if self.sampling.eos:
            going = self.going[m].to(tokens.device)
            tokens = torch.where(going, tokens, torch.full_like(tokens, self.sampling.pad))
        message = torch.cat([tokens.long(), torch.tensor([status], device=tokens.device)])
        for rank in sorted({self.ring.rank_of(s) for s in range(self.ring.n_stages)} - {self.ring.rank}):
            self.sent.append(dist.isend(message.to(self.ring.wire), dst=rank, group=self.ring.group))
        self._take(t, m, message)

    def receive_tokens(self, t: int, m: int) -> None:
        rows = self.bounds[m]
        message = torch.zeros(rows.stop - rows.start + 1, dtype=torch.long, device=self.ring.wire)
        dist.recv(message, src=self.ring.rank_of(self.ring.n_stages - 1), group=self.ring.group)
        self._take(t, m, message)

    def _take(self, t: int, m: int, message: torch.Tensor) -> None:
        status = int(message[-1])
        if status:
            raise PipelineConfigError(
                f"stage {status} of the pipeline computes other inputs for its layers than the first stage does (the"
                " position embeddings or masks the model passes each layer): a part another stage holds feeds them."
                " generate refuses rather than sample from a different model; keep such parts parameter-free, or"
                " compute them in each layer."
            )
        tokens = message[:-1].to(self.input_ids.device)
        self.tokens[m].append(tokens)
        if self.sampling.eos:
            eos = torch.tensor(self.sampling.eos, device=tokens.device)
            self.going[m] &= ~torch.isin(tokens, eos)
            if not bool(self.going[m].any()):
                self.ended[m] = t

    def settle(self) -> None:
        for work in self.sent:
            work.wait()
        self.sent.clear()

    def sequences(self) -> torch.Tensor:
        steps = max(len(tokens) for tokens in self.tokens)
        pad = self.sampling.pad
        lanes = []
        for tokens, rows in zip(self.tokens, self.bounds):
            new = torch.stack(tokens, dim=1) if tokens else self.input_ids.new_zeros(rows.stop - rows.start, 0)
            filler = new.new_full((new.shape[0], steps - new.shape[1]), pad)
            lanes.append(torch.cat([self.input_ids[rows], new.to(self.input_ids.dtype), filler], dim=1))
        return torch.cat(lanes)
