"""Pretrained weights in: a ~250 MB HF Llama saved locally in several safetensors shards, loaded on 4 stages
by ``init_weights`` (built on meta, each rank reading its own tensors) against every rank calling
``from_pretrained`` (the route before ``init_weights``; the strategy then prunes). Per rank: peak RSS growth
(from before the model is built, over the whole model's bytes; its stage's share of the model beside it), and
the time from building the model to the end of the first step. Bytes read are not reported: safetensors are
read through memory maps, which /proc's read counters do not see (each rank asks DCP for its stage's tensors
only: the strategy logs rank 0's MiB).

    python benchmarks/pretrained.py

SGD, 2 steps of 16 sequences of 16 tokens, split="trace", 1F1B, torch's kernels paged in before counting
(run_pretrained.py). Writes benchmarks/results/pretrained.json and prints a Markdown table. Target (issue 29):
peak growth <= 0.6x the model with SGD.
"""

from __future__ import annotations

import json
import tempfile
from pathlib import Path

from common import launch, machine

HERE = Path(__file__).parent
LLAMA = dict(
    vocab_size=8192, hidden_size=768, intermediate_size=2048, num_hidden_layers=8, num_attention_heads=12,
    num_key_value_heads=4, max_position_embeddings=64, use_cache=False, tie_word_embeddings=False,
)  # fmt: skip
RANKS = 4


def main() -> None:
    import torch
    from transformers import LlamaConfig, LlamaForCausalLM

    runs = []
    with tempfile.TemporaryDirectory() as tmp:
        saved = Path(tmp) / "llama"
        torch.manual_seed(0)
        LlamaForCausalLM(LlamaConfig(**LLAMA)).save_pretrained(saved, max_shard_size="50MB")
        shards = len(list(saved.glob("*.safetensors")))
        for route in ("init_weights", "from_pretrained"):
            result = launch("run_pretrained.py", route, saved, ranks=RANKS)
            whole = result["whole_bytes"]
            rows = result["ranks"]
            runs.append({
                "route": route, "ranks": RANKS, "whole_bytes": whole, "shards": shards,
                "peak_growth_over_whole": [r["peak_growth"] / whole for r in rows],
                "stage_over_whole": [r["stage_bytes"] / whole for r in rows],
                "stage_bytes": [r["stage_bytes"] for r in rows],
                "first_step_s": [r["first_step_s"] for r in rows],
            })  # fmt: skip
    result = {"benchmark": "pretrained", "machine": machine(), "config": LLAMA, "runs": runs}
    (HERE / "results" / "pretrained.json").write_text(json.dumps(result, indent=1))
    model = f"{RANKS} stages, {runs[0]['whole_bytes'] / 2**20:.0f} MiB in {runs[0]['shards']} shards"
    print(f"| route ({model}) | peak growth / whole model, per rank | own stage / whole model | first step, s (max) |")
    print("| --- | --- | --- | --- |")
    for r in runs:
        peaks, stages = (" ".join(f"{x:.2f}" for x in r[k]) for k in ("peak_growth_over_whole", "stage_over_whole"))
        print(f"| {r['route']} | {peaks} | {stages} | {max(r['first_step_s']):.1f} |")


if __name__ == "__main__":
    main()
