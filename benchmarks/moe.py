"""Qwen3-MoE-style models (16 experts of hidden 512, 412 MiB in float32; 32 narrower experts of hidden 384) on
2 stages x 2 replicas (4 ranks, ``split="trace"``, 1F1B, AdamW, built on meta), their experts whole on each
replica rank or split over the replicas (``expert_parallel_size=2``), against the dense Qwen3 of the same active
parameters (an MLP as wide as the experts a token uses). Per run: each rank's peak RSS growth from before the
model is built, the experts' bytes each rank holds, tokens per second (median step after the warm-up, both
replicas' tokens).

    python benchmarks/moe.py [--steps 8]

Writes benchmarks/results/moe.json and prints a Markdown table. Targets (issue 39): the experts' bytes per rank
fall by the expert-parallel size; the run stays exact (tests/test_moe.py checks that, not this).
"""

from __future__ import annotations

import argparse
import json
import statistics
from pathlib import Path

from common import launch, machine, step_times
from run_moe import BATCH, SEQ, M

HERE = Path(__file__).parent
SHAPE = dict(vocab_size=1024, hidden_size=512, num_hidden_layers=8, num_attention_heads=8, num_key_value_heads=4,
             head_dim=64, max_position_embeddings=SEQ, use_cache=False, tie_word_embeddings=False)  # fmt: skip
MOE = dict(SHAPE, model_type="qwen3_moe", num_experts=16, num_experts_per_tok=2, moe_intermediate_size=512,
           intermediate_size=1024, decoder_sparse_step=1, norm_topk_prob=True)  # fmt: skip
# a second shape: twice the experts, each narrower, a narrower model (the same code, other proportions)
MANY = dict(
    MOE, hidden_size=384, num_attention_heads=6, num_key_value_heads=2, num_experts=32, moe_intermediate_size=256
)
SHAPES = {"16 experts, hidden 512": MOE, "32 experts, hidden 384": MANY}


def _runs(moe: dict) -> dict[str, tuple[str, dict, int]]:
    dense = dict(
        SHAPE,
        **{k: moe[k] for k in ("hidden_size", "num_attention_heads", "num_key_value_heads")},
        model_type="qwen3",
        intermediate_size=moe["num_experts_per_tok"] * moe["moe_intermediate_size"],
    )
    return {"moe, experts whole (ep=1)": ("moe", moe, 1), "moe, experts split (ep=2)": ("moe", moe, 2),
            "dense, same active parameters": ("dense", dense, 1)}  # fmt: skip


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--steps", type=int, default=8)
    args = parser.parse_args()
    shapes = {}
    for shape, moe in SHAPES.items():
        runs = {}
        for name, (kind, config, ep) in _runs(moe).items():
            result = launch("run_moe.py", kind, ep, args.steps, json.dumps(config), ranks=4)
            rows = result["ranks"]
            step = statistics.median(step_times(rows[0]["ends"]))
            runs[name] = {
                "config": config, "expert_parallel_size": ep, "whole_bytes": result["whole_bytes"],
                "experts_whole_bytes": result["experts_whole_bytes"],
                "peak_growth_bytes": [r["peak_growth"] for r in rows], "stage_bytes": [r["stage_bytes"] for r in rows],
                "expert_bytes": [r["expert_bytes"] for r in rows], "step_s": step,
                "tokens_per_s": 2 * BATCH * SEQ / step,
            }  # fmt: skip
        shapes[shape] = runs
    out = {"benchmark": "moe", "machine": machine(), "config": {"ranks": 4, "stages": 2, "replicas": 2,
           "batch_per_replica": BATCH, "seq": SEQ, "n_microbatches": M, "steps": args.steps, "optimizer": "AdamW"},
           "shapes": shapes}  # fmt: skip
    (HERE / "results" / "moe.json").write_text(json.dumps(out, indent=1))
    print("| model | run | whole, MiB | experts held per rank, MiB | stage held per rank, MiB"
          " | peak growth per rank, MiB | tokens/s |")  # fmt: skip
    print("| --- | --- | --- | --- | --- | --- | --- |")
    mib = lambda values: " ".join(f"{v / 2**20:.0f}" for v in values)  # noqa: E731
    for shape, runs in shapes.items():
        for name, r in runs.items():
            print(f"| {shape} | {name} | {r['whole_bytes'] / 2**20:.0f} | {mib(r['expert_bytes'])} |"
                  f" {mib(r['stage_bytes'])} | {mib(r['peak_growth_bytes'])} | {r['tokens_per_s']:.0f} |")  # fmt: skip


if __name__ == "__main__":
    main()
