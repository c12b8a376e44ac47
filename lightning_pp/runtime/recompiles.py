"""After the warm-up, a compiled block that compiles again, or runs eagerly, is said once per rank with dynamo's
reason: dynamo itself only warns once it gives up (its recompile limit), after which a run is eager and unseen.

The first training step compiles (each block's graph, on every rank); later steps should only run what is
compiled. A new batch shape (the last partial batch) compiles again, legitimately; that is said too, with the guard
that failed, so that a run that keeps recompiling is visible before dynamo gives up. Validation's no-grad graphs
are taken in without a word.
"""

from __future__ import annotations

import logging

log = logging.getLogger(__name__)


def dynamo_counts() -> tuple[int, int]:
    """Graphs dynamo compiled in this process so far, and the frames it gave up on (ran eagerly)."""
    from torch._dynamo.utils import counters

    return counters["stats"]["unique_graphs"], counters["frames"]["total"] - counters["frames"]["ok"]


class RecompileWatch:
    """Dynamo's graph and frame counts from one training step to the next (nothing where nothing is compiled)."""

    def __init__(self, rank: int) -> None:
        self.rank = rank
        self._seen: tuple[int, int] | None = None
        self._failures: dict[object, int] = {}  # guard failures dynamo had recorded per code object, at the last look
        self._said = False

    def step_done(self, train: bool) -> None:
        """After each step: a training step that compiled, or ran eagerly, is said (once); what validation's
        no-grad forward compiles is taken in silently."""
        from torch._dynamo.utils import guard_failures

        now = dynamo_counts()
        if train and self._seen is not None and now != self._seen and not self._said:
            graphs, eager = now[0] - self._seen[0], now[1] - self._seen[1]
            new = [r for code, failed in guard_failures.items() for r in failed[self._failures.get(code, 0) :]]
            reasons = "; ".join(dict.fromkeys(r.strip() for r in new)) or "none given"  # each cached graph's guard
            log.warning(
                f"Rank {self.rank}: after the first training step, dynamo compiled {graphs} more graph(s) and ran"
                f" {eager} frame(s) eagerly (said once; dynamo's reasons: {reasons})."
                " A new batch shape compiles again; compile={'dynamic': True} compiles one graph for all lengths."
            )
            self._said = True
        if train or self._seen is not None:
            self._seen = now
            self._failures = {code: len(failed) for code, failed in guard_failures.items()}
