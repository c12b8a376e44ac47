"""What the checkpoint records cost: a sharded save with and without each file's size and block CRC-32s
(``checkpoints.integrity``), written synchronously and in the background, and the check a resume makes
against reading the shards back.

    python benchmarks/checksums.py [--rounds 5]

Per rank 64, 256 and 1024 MB of float32 weights (4 MB tensors), on 1 and 2 ranks (torchrun, gloo, one thread
each), saves paired in alternating order each round, the slowest rank's seconds. Writes
benchmarks/results/checksums.json and prints a Markdown table. Target (issue 64): the records within 5% of the
save's time.
"""

from __future__ import annotations

import argparse
import json
import statistics
import tempfile

from common import HERE, launch, machine

SIZES_MB = (64, 256, 1024)


def summary(rounds: list[dict[str, float]]) -> dict[str, float]:
    median = lambda key: statistics.median(r[key] for r in rounds)  # noqa: E731
    ratio = lambda a, b: statistics.median(r[a] / r[b] for r in rounds)  # noqa: E731
    return {
        "sync_plain_s": median("sync_plain_s"),
        "sync_recorded_over_plain": ratio("sync_recorded_s", "sync_plain_s"),
        "async_blocking_recorded_over_plain": ratio("async_recorded_blocking_s", "async_plain_blocking_s"),
        "async_done_recorded_over_plain": ratio("async_recorded_done_s", "async_plain_done_s"),
        "read_s": median("read_s"),
        "check_over_read": ratio("check_s", "read_s"),
    }


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--rounds", type=int, default=5)
    args = parser.parse_args()
    runs = []
    for ranks in (1, 2):
        for mb in SIZES_MB:
            with tempfile.TemporaryDirectory(dir=HERE.parent) as tmp:  # the disk checkpoints go to, not a tmpfs
                result = launch("run_checksums.py", mb, args.rounds, tmp, ranks=ranks)
            runs.append({"ranks": ranks, "mb_per_rank": mb, **summary(result["rounds"]), "rounds": result["rounds"]})
    (HERE / "results" / "checksums.json").write_text(
        json.dumps({"benchmark": "checksums", "machine": machine(), "runs": runs}, indent=2)
    )
    print("| ranks | MB per rank | sync save (s) | sync: with records / without | async: blocking | async: done |"
          " check / read back |")  # fmt: skip
    print("| --- | --- | --- | --- | --- | --- | --- |")
    for r in runs:
        print(f"| {r['ranks']} | {r['mb_per_rank']} | {r['sync_plain_s']:.3f} | {r['sync_recorded_over_plain']:.3f} |"
              f" {r['async_blocking_recorded_over_plain']:.3f} | {r['async_done_recorded_over_plain']:.3f} |"
              f" {r['check_over_read']:.3f} |")  # fmt: skip


if __name__ == "__main__":
    main()
