"""Generation through the pipeline against one process: tokens per second of greedy decoding of an HF Llama
(weights from a seed) with a key/value cache, through 2 and 4 ranks (``strategy.generate``, one micro-batch lane
per stage, the ranks' threads summing to the machine's cores) and on one process (Hugging Face's ``generate``
with every core), batch 1 and 8, prompts of 32 tokens, 32 new ones; each rank's cache bytes against its layers'
share of one process's cache; and whether the tokens are the same.

    python benchmarks/generate.py [--shapes llama-30M,llama-120M] [--new 32]

Writes benchmarks/results/generate.json and prints a Markdown table (docs/generate.md).
"""

from __future__ import annotations

import argparse
import json
import os
from pathlib import Path

from common import launch, machine
from run_generate import BATCHES, SHAPES

HERE = Path(__file__).parent
PROMPT = 32


def cache_bytes(shape: dict, rows: int, positions: int) -> int:
    """One process's whole cache: keys and values of every layer in float32."""
    head = shape["hidden_size"] // shape["num_attention_heads"]
    return 2 * shape["num_hidden_layers"] * rows * shape["num_key_value_heads"] * positions * head * 4


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--shapes", default=",".join(SHAPES))
    parser.add_argument("--new", type=int, default=32)
    args = parser.parse_args()
    cores = os.cpu_count() or 1
    results = {}
    for shape in args.shapes.split(","):
        runs = {"one process": launch("run_generate.py", "single", shape, PROMPT, args.new, extra=str(cores),
                                      ranks=None)}  # fmt: skip
        for ranks in (2, 4):
            runs[f"{ranks} ranks"] = launch("run_generate.py", "pipeline", shape, PROMPT, args.new, ranks=ranks)
        rows_out = {}
        for rows in BATCHES:
            one = runs["one process"]["batches"][str(rows)]
            whole = cache_bytes(SHAPES[shape], rows, PROMPT + args.new - 1)
            for name, run in runs.items():
                r = run["batches"][str(rows)]
                rows_out[f"{name}, batch {rows}"] = {
                    "tokens_per_s": rows * args.new / r["seconds"],
                    "over_one_process": one["seconds"] / r["seconds"],
                    "same_tokens": r["tokens"] == one["tokens"],
                    "cache_bytes_per_rank": r.get("cache_bytes"),
                    "cache_over_whole": [b / whole for b in r.get("cache_bytes") or []],
                }
        results[shape] = {"model": SHAPES[shape], "runs": rows_out}
    config = {"prompt": PROMPT, "new_tokens": args.new, "greedy": True, "threads": f"{cores} in all, per run"}
    out = {"benchmark": "generate", "machine": machine(), "config": config, "shapes": results}
    (HERE / "results" / "generate.json").write_text(json.dumps(out, indent=1))
    print("| model | run | tokens/s | vs one process | same tokens | cache per rank / one process's |")
    print("| --- | --- | --- | --- | --- | --- |")
    for shape, result in results.items():
        for name, r in result["runs"].items():
            share = " ".join(f"{c:.3f}" for c in r["cache_over_whole"]) or "1"
            print(f"| {shape} | {name} | {r['tokens_per_s']:.1f} | {r['over_one_process']:.2f}x |"
                  f" {'yes' if r['same_tokens'] else 'NO'} | {share} |")  # fmt: skip


if __name__ == "__main__":
    main()
