"""Models split by torch's tracer (``split="trace"``: Hugging Face GPT-2, Llama, Qwen3-MoE from configs, 256 wide,
4 layers, batch 8 of 64 tokens, 1F1B m=4, 2 ranks) through this checkout and another one (``--against``, e.g. a
``git worktree`` of an earlier commit), in alternated rounds: the median over rounds of each round's step time
ratio (this / against; the two runs of a round are adjacent in time, and this VM drifts more between minutes).

    python benchmarks/traced.py --against /tmp/base [--rounds 3] [--steps 12]

Writes benchmarks/results/traced.json and prints a Markdown table.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
from pathlib import Path

from common import RESULTS, launch, machine, median_spread, step_times

HERE = Path(__file__).parent
COMMON = dict(vocab_size=1024, max_position_embeddings=64, use_cache=False, tie_word_embeddings=False)
SHAPES = {
    "GPT-2": dict(COMMON, model_type="gpt2", n_embd=256, n_layer=4, n_head=4, n_positions=64),
    "Llama": dict(COMMON, model_type="llama", hidden_size=256, intermediate_size=688, num_hidden_layers=4,
                  num_attention_heads=4, num_key_value_heads=2),
    "Qwen3-MoE": dict(COMMON, model_type="qwen3_moe", hidden_size=256, num_hidden_layers=4, num_attention_heads=4,
                      num_key_value_heads=2, head_dim=64, num_experts=8, num_experts_per_tok=2,
                      moe_intermediate_size=256, intermediate_size=688),
}  # fmt: skip


def _steps(config: dict, steps: int, package: str | None) -> list[float]:
    saved = os.environ.get("PYTHONPATH")
    os.environ["PYTHONPATH"] = os.pathsep.join(filter(None, [package or str(HERE.parent), saved]))
    try:
        return step_times(launch("run_traced.py", json.dumps(config), steps)["ends"])
    finally:
        os.environ.pop("PYTHONPATH") if saved is None else os.environ.__setitem__("PYTHONPATH", saved)


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--against", required=True, help="a checkout of lightning_pp to compare with")
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--steps", type=int, default=12)
    args = parser.parse_args()
    rows = {}
    for name, config in SHAPES.items():
        ours, theirs = [], []
        for i in range(args.rounds):
            order = [(ours, None), (theirs, args.against)][:: 1 if i % 2 == 0 else -1]
            for into, package in order:
                into.append(statistics.median(_steps(config, args.steps, package)))
        rows[name] = {
            "this_s": median_spread(ours),
            "against_s": median_spread(theirs),
            "ratio": statistics.median(a / b for a, b in zip(ours, theirs)),
        }
        print(name, rows[name], flush=True)
    out = {"machine": machine(), "against": args.against, "rounds": args.rounds, "steps": args.steps, "rows": rows}
    RESULTS.mkdir(parents=True, exist_ok=True)
    (RESULTS / "traced.json").write_text(json.dumps(out, indent=1))
    print("| model | this step | against | ratio (median of rounds) |\n| --- | --- | --- | --- |")
    for name, r in rows.items():
        print(f"| {name} | {r['this_s']['median']:.3f} s | {r['against_s']['median']:.3f} s | **{r['ratio']:.2f}** |")


if __name__ == "__main__":
    main()
