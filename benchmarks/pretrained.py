"""Pretrained weights in: a ~250 MB HF Llama saved locally in several safetensors shards, loaded on 4 stages
by ``init_weights`` (built on meta, each rank reading its own tensors) against every rank calling
``from_pretrained`` (the route before ``init_weights``; the strategy then prunes). Per rank: peak RSS growth
from before the model is built (over the whole model's bytes), up to the end of the load and over the run;
what the run holds beyond its stage's parameters and gradients (MiB); the bytes of the files the load reads;
the time from building the model to the end of the first step.

Bytes read: safetensors are read through memory maps, which /proc's read counters do not see, so each rank's
read is repeated afterwards in this process with the rank's own tensor names (``load_weights``, as the
strategy calls it), the files' pages first dropped from the page cache, and the pages the read brought back
counted (``mincore``; the kernel's read-ahead included). ``from_pretrained`` is counted the same way.

    python benchmarks/pretrained.py

SGD, 2 steps of 16 sequences of 16 tokens, split="trace", 1F1B, torch's kernels paged in before counting
(run_pretrained.py). Writes benchmarks/results/pretrained.json and prints a Markdown table. Target (issue 29):
peak growth <= 0.6x the model with SGD.
"""

from __future__ import annotations

import ctypes
import json
import mmap
import os
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
            read, opening = bytes_read(saved, [r["names"] for r in rows]) if route == "init_weights" else ([], 0)
            runs.append({
                "route": route, "ranks": RANKS, "whole_bytes": whole, "shards": shards,
                "peak_growth_over_whole": [r["peak_growth"] / whole for r in rows],
                "load_peak_growth_over_whole": [r["load_peak_growth"] / whole for r in rows],
                "beyond_params_and_grads_mib": [(r["peak_growth"] - 2 * r["stage_bytes"]) / 2**20 for r in rows],
                "stage_over_whole": [r["stage_bytes"] / whole for r in rows],
                "read_over_stage": [b / r["stage_bytes"] for b, r in zip(read, rows)],
                "read_less_opening_over_stage": [(b - opening) / r["stage_bytes"] for b, r in zip(read, rows)],
                "stage_bytes": [r["stage_bytes"] for r in rows],
                "read_bytes": read,
                "opening_bytes": opening,
                "first_step_s": [r["first_step_s"] for r in rows],
            })  # fmt: skip
    result = {"benchmark": "pretrained", "machine": machine(), "config": LLAMA, "runs": runs}
    (HERE / "results" / "pretrained.json").write_text(json.dumps(result, indent=1))
    model = f"{RANKS} stages, {runs[0]['whole_bytes'] / 2**20:.0f} MiB in {runs[0]['shards']} shards"
    columns = {
        "own stage / whole model": ("stage_over_whole", "{:.2f}"),
        "peak growth / whole model": ("peak_growth_over_whole", "{:.2f}"),
        "peak growth up to the end of the load / whole": ("load_peak_growth_over_whole", "{:.2f}"),
        "peak beyond params + grads, MiB": ("beyond_params_and_grads_mib", "{:.0f}"),
        "bytes read / own stage": ("read_over_stage", "{:.2f}"),
        "less opening the shards": ("read_less_opening_over_stage", "{:.2f}"),
    }
    print(f"| route ({model}), per rank | " + " | ".join(columns) + " | first step, s (max) |")
    print("| --- " * (len(columns) + 2) + "|")
    for r in runs:
        cells = [" ".join(form.format(x) for x in r[key]) or "-" for key, form in columns.values()]
        print(f"| {r['route']} | " + " | ".join(cells) + f" | {max(r['first_step_s']):.1f} |")
    opening = runs[0]["opening_bytes"] / 2**20
    print(f"\nOpening the {runs[0]['shards']} shards (the smallest tensor read alone): {opening:.1f} MiB")


def bytes_read(saved: Path, names_per_rank: list[list[str]]) -> tuple[list[int], int]:
    """The bytes of ``saved``'s files each rank's read brings into the page cache (``load_weights`` with the
    rank's tensor names), and those of reading the smallest tensor alone (opening the files)."""
    import torch
    from run_pretrained import Llama
    from transformers import AutoConfig

    from lightning_pp.checkpoints.pretrained import WeightMap, load_weights, match_weights, open_pretrained

    files = sorted(saved.glob("*.safetensors"))
    pretrained = open_pretrained(saved)
    with torch.device("meta"):
        module = Llama(AutoConfig.from_pretrained(saved))
    module.to_empty(device="cpu")
    weights = match_weights(pretrained, module)
    smallest = min(weights.keys, key=lambda n: module.get_parameter(n).numel())
    read = []
    for names in [*names_per_rank, [smallest]]:
        _drop_from_page_cache(files)
        load_weights(pretrained, WeightMap({n: k for n, k in weights.keys.items() if n in set(names)}), module)
        read.append(_in_page_cache(files))
    return read[:-1], read[-1]


def _drop_from_page_cache(files: list[Path]) -> None:
    for file in files:
        fd = os.open(file, os.O_RDONLY)
        os.fsync(fd)  # dirty pages cannot be dropped
        os.posix_fadvise(fd, 0, 0, os.POSIX_FADV_DONTNEED)
        os.close(fd)
    assert _in_page_cache(files) == 0, "the page cache kept the files' pages: bytes read would be wrong"


def _in_page_cache(files: list[Path]) -> int:
    libc = ctypes.CDLL("libc.so.6", use_errno=True)
    page = os.sysconf("SC_PAGE_SIZE")
    pages = 0
    for file in files:
        size = file.stat().st_size
        with open(file, "rb") as f, mmap.mmap(f.fileno(), size, access=mmap.ACCESS_COPY) as mapped:
            start = ctypes.c_char.from_buffer(mapped)
            vec = (ctypes.c_ubyte * ((size + page - 1) // page))()
            if libc.mincore(ctypes.c_void_p(ctypes.addressof(start)), ctypes.c_size_t(size), vec) != 0:
                raise OSError(ctypes.get_errno(), "mincore")
            pages += sum(v & 1 for v in vec)
            del start
    return pages * page


if __name__ == "__main__":
    main()
