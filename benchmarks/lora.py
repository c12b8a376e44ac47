"""Fine-tuning with adapters against a full fine-tune of the same pretrained HF Llama (saved here in safetensors
shards, no download), 4 stages (split="trace", 1F1B), built on meta and read by ``init_weights``, AdamW, sharded
checkpoints, at two sizes: 240 MiB (``pretrained.py``'s: 8 layers of 768) and 490 MiB (10 layers of 1024). Per
size and route: each rank's peak RSS growth from before the model is built (over the whole model's bytes), the
median step time after the warm-up, the checkpoint's bytes on disk and the save's wall time.

    python benchmarks/lora.py [--steps 8] [--shapes 240MiB,490MiB]

LoRA: r=16 on q/k/v/o projections (peft). Writes benchmarks/results/lora.json and prints a Markdown table.
Targets (issue 38): LoRA's peak growth <= 0.4x the full fine-tune's; its checkpoint <= 5% of a full one.
"""

from __future__ import annotations

import argparse
import json
import statistics
import tempfile
from pathlib import Path

from common import launch, machine, step_times
from pretrained import LLAMA

HERE = Path(__file__).parent
RANKS = 4
SHAPES = {
    "240MiB": LLAMA,
    "490MiB": dict(LLAMA, hidden_size=1024, intermediate_size=2816, num_hidden_layers=10, num_attention_heads=16),
}


def main() -> None:
    import torch
    from transformers import LlamaConfig, LlamaForCausalLM

    parser = argparse.ArgumentParser()
    parser.add_argument("--steps", type=int, default=8)
    parser.add_argument("--shapes", default=",".join(SHAPES))
    args = parser.parse_args()
    results = {}
    for shape in args.shapes.split(","):
        runs = {}
        with tempfile.TemporaryDirectory() as tmp:
            saved = Path(tmp) / "llama"
            torch.manual_seed(0)
            LlamaForCausalLM(LlamaConfig(**SHAPES[shape])).save_pretrained(saved, max_shard_size="50MB")
            for route in ("full", "lora"):
                result = launch("run_lora.py", route, saved, args.steps, ranks=RANKS)
                whole, rows = result["whole_bytes"], result["ranks"]
                runs[route] = {
                    "whole_bytes": whole, "trainable_parameters": result["trainable"],
                    "peak_growth_bytes": [r["peak_growth"] for r in rows],
                    "peak_growth_over_whole": [r["peak_growth"] / whole for r in rows],
                    "step_s": statistics.median(step_times(rows[0]["ends"])),
                    "checkpoint_bytes": result["checkpoint_bytes"], "save_s": result["save_s"],
                }  # fmt: skip
        full, lora = runs["full"], runs["lora"]
        ratios = {
            "peak_growth_lora_over_full": max(lora["peak_growth_bytes"]) / max(full["peak_growth_bytes"]),
            "checkpoint_lora_over_full": lora["checkpoint_bytes"] / full["checkpoint_bytes"],
            "step_lora_over_full": lora["step_s"] / full["step_s"],
        }
        results[shape] = {"model": SHAPES[shape], "runs": runs, "ratios": ratios}
    config = {"ranks": RANKS, "steps": args.steps, "lora": "r=16 on q/k/v/o", "optimizer": "AdamW"}
    out = {"benchmark": "lora", "machine": machine(), "config": config, "shapes": results}
    (HERE / "results" / "lora.json").write_text(json.dumps(out, indent=1))
    print("| model | route | trainable params | peak growth / whole model (per rank) | step, s | checkpoint, MiB"
          " | save, s |")  # fmt: skip
    print("| --- | --- | --- | --- | --- | --- | --- |")
    for shape, result in results.items():
        for route, r in result["runs"].items():
            growth = " ".join(f"{g:.2f}" for g in r["peak_growth_over_whole"])
            print(f"| {shape} | {route} | {r['trainable_parameters'] / 1e6:.1f} M | {growth} | {r['step_s']:.2f} |"
                  f" {r['checkpoint_bytes'] / 2**20:.1f} | {r['save_s']:.2f} |")  # fmt: skip
    print("\n| model | LoRA / full: peak growth (target <= 0.4) | checkpoint (target <= 0.05) | step time |")
    print("| --- | --- | --- | --- |")
    for shape, result in results.items():
        q = result["ratios"]
        print(f"| {shape} | {q['peak_growth_lora_over_full']:.2f} | {q['checkpoint_lora_over_full']:.3f} |"
              f" {q['step_lora_over_full']:.2f} |")  # fmt: skip


if __name__ == "__main__":
    main()
