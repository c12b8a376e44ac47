"""What ``generate`` chooses at each step, on the last stage, as ``model.generate`` on one process would.

The logits warpers are transformers' own (temperature, then top-k, then top-p, in ``generate``'s order), and a
sample is drawn as ``torch.multinomial`` draws one: one exponential variate per row and token of the whole
batch each step (``q``), the token the argmax of ``probs / q``. Drawing the batch's variates at once lets the
micro-batches reach the last stage at different times and still take the very numbers one process takes.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import torch

from lightning_pp.errors import PipelineConfigError


@dataclass(frozen=True)
class Sampling:
    """``generate``'s arguments, checked on every rank before any message is sent.

    ``top_k=None`` and ``top_p=None`` switch those warpers off (Hugging Face's ``generate`` applies its
    generation config's ``top_k=50`` unless given one: pass ``top_k=50`` for that). Finished rows are padded with
    ``pad_token_id`` (default: the first ``eos_token_id``), as ``generate`` pads them. ``seed=None`` samples
    from the last stage's default generator (not reproducible against one process).
    """

    max_new_tokens: int = 20
    do_sample: bool = False
    temperature: float = 1.0
    top_k: int | None = None
    top_p: float | None = None
    eos_token_id: int | list[int] | None = None
    pad_token_id: int | None = None
    seed: int | None = None
    microbatches: int | None = None

    def __post_init__(self) -> None:
        checks = [
            ("max_new_tokens", self.max_new_tokens, isinstance(self.max_new_tokens, int) and self.max_new_tokens >= 1,
             "a count of tokens >= 1"),
            ("temperature", self.temperature, isinstance(self.temperature, (int, float)) and self.temperature > 0,
             "a number > 0"),
            ("top_k", self.top_k, self.top_k is None or (isinstance(self.top_k, int) and self.top_k >= 1),
             "None or a count >= 1"),
            ("top_p", self.top_p, self.top_p is None or 0 < self.top_p <= 1, "None or a number in (0, 1]"),
            ("microbatches", self.microbatches,
             self.microbatches is None or (isinstance(self.microbatches, int) and self.microbatches >= 1),
             "None (one per stage) or a count >= 1"),
        ]  # fmt: skip
        for name, value, good, want in checks:
            if not good:
                raise PipelineConfigError(f"generate({name}={value!r}): pass {want}.")

    @property
    def eos(self) -> tuple[int, ...]:
        eos = self.eos_token_id if self.eos_token_id is not None else ()
        return (int(eos),) if isinstance(eos, int) else tuple(int(e) for e in eos)

    @property
    def pad(self) -> int:
        return self.pad_token_id if self.pad_token_id is not None else self.eos[0] if self.eos else 0


class Chooser:
    """The last stage's choice of each row's next token; one per ``generate`` call."""

    def __init__(self, sampling: Sampling, rows: int, device: torch.device) -> None:
        self.sampling = sampling
        self.rows = rows
        self.warpers = _warpers(sampling) if sampling.do_sample else []
        self.generator: torch.Generator | None = None
        if sampling.do_sample and sampling.seed is not None:
            self.generator = torch.Generator(device=device).manual_seed(sampling.seed)
        self._q: tuple[int, torch.Tensor] | None = None  # the step's variates for the whole batch

    def choose(self, logits: torch.Tensor, rows: slice, step: int) -> torch.Tensor:
        """The next tokens of ``rows`` of the batch from their logits (rows, vocabulary) at ``step``."""
        scores = logits.to(dtype=torch.float32, copy=True)
        for warper in self.warpers:
            scores = warper(None, scores)
        if not self.sampling.do_sample:
            return torch.argmax(scores, dim=-1)
        probs = torch.softmax(scores, dim=-1)
        return torch.argmax(probs / self._variates(step, probs)[rows], dim=-1)

    def _variates(self, step: int, probs: torch.Tensor) -> torch.Tensor:
        """What ``torch.multinomial(probs, 1)`` draws for the whole batch at ``step``: drawn at the step's first
        micro-batch, the later ones of the step reading their rows."""
        if self._q is None or self._q[0] != step:
            q = torch.empty((self.rows, probs.shape[-1]), dtype=probs.dtype, device=probs.device)
            self._q = (step, q.exponential_(1, generator=self.generator))
        return self._q[1]


def _warpers(sampling: Sampling) -> list[Any]:
    try:
        from transformers.generation.logits_process import (
            TemperatureLogitsWarper,
            TopKLogitsWarper,
            TopPLogitsWarper,
        )
    except ImportError as error:  # pragma: no cover (transformers is what generation is built on)
        raise PipelineConfigError("generate(do_sample=True) needs transformers: pip install transformers") from error
    warpers: list[Any] = []
    if sampling.temperature != 1.0:
        warpers.append(TemperatureLogitsWarper(float(sampling.temperature)))
    if sampling.top_k is not None:
        warpers.append(TopKLogitsWarper(top_k=sampling.top_k, min_tokens_to_keep=1))
    if sampling.top_p is not None and sampling.top_p < 1.0:
        warpers.append(TopPLogitsWarper(top_p=float(sampling.top_p), min_tokens_to_keep=1))
    return warpers
