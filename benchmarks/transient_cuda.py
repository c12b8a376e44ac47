"""What the planner counts of a backward (``lightning_pp.split.transient``) against CUDA's allocator, on one GPU.

    python benchmarks/transient_cuda.py

A vocabulary head (LayerNorm, Linear, cross-entropy in fp32) at three sizes up to Llama 3's 128256 tokens, and an
``nn.TransformerEncoderLayer`` block at three sizes, each in fp32 and under bf16 autocast: after a warm-up backward
(cuBLAS's workspace is the allocator's, not an operation's), the forward with the saved tensors watched as the
profile watches them, then the backward inside ``BackwardBytes``, against ``max_memory_allocated`` over the
backward less what was allocated when it began. Each case is counted gross (every storage the backward makes) and
net (less the saved activations it frees: what the package counts). Writes benchmarks/results/transient_cuda.json
(or ``$BENCH_RESULTS``) and prints a Markdown table.

The module is loaded from its file, alone (it needs nothing but torch): the GPU machines lent to this work had
torch 2.11, which the package itself refuses.
"""

from __future__ import annotations

import importlib.util
import json
from collections.abc import Callable
from pathlib import Path

import torch
from common import RESULTS, machine
from torch import nn

HERE = Path(__file__).parent
_spec = importlib.util.spec_from_file_location("transient", HERE.parent / "lightning_pp/split/transient.py")
transient = importlib.util.module_from_spec(_spec)
_spec.loader.exec_module(transient)
MIB = 2**20


class Head(nn.Module):
    def __init__(self, d: int, vocab: int) -> None:
        super().__init__()
        self.norm, self.out = nn.LayerNorm(d), nn.Linear(d, vocab, bias=False)

    def forward(self, x: torch.Tensor, y: torch.Tensor) -> torch.Tensor:
        return nn.functional.cross_entropy(self.out(self.norm(x)).flatten(0, 1).float(), y.flatten())


class Block(nn.Module):
    def __init__(self, d: int) -> None:
        super().__init__()
        self.layer = nn.TransformerEncoderLayer(d, 8, 4 * d, dropout=0.0, batch_first=True)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.layer(x).square().mean()


def measure(model: nn.Module, inputs: Callable[[], tuple], dtype: torch.dtype | None, net: bool) -> tuple[int, int]:
    """Bytes counted over the backward, and CUDA's peak over it, of the second of two forward-backward passes."""
    args = inputs()
    _one_pass(model, args, dtype, net)
    return _one_pass(model, args, dtype, net)


def _one_pass(model: nn.Module, args: tuple, dtype: torch.dtype | None, net: bool) -> tuple[int, int]:
    params = {p.untyped_storage()._cdata for p in model.parameters()}
    model.zero_grad(set_to_none=True)
    counted, seen = transient.BackwardBytes(1), set()

    def pack(t: torch.Tensor) -> torch.Tensor:  # as the profile's saved-tensor hook: each storage once
        key = t.untyped_storage()._cdata
        if key not in params and key not in seen:
            seen.add(key)
            if net:
                counted.watch(t.untyped_storage())
        return t

    with torch.autocast("cuda", dtype=dtype, enabled=dtype is not None):
        with torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t):
            loss = model(*args)
    torch.cuda.synchronize()
    base = torch.cuda.memory_allocated()
    torch.cuda.reset_peak_memory_stats()
    with counted:
        loss.backward()
    torch.cuda.synchronize()
    return counted.peaks[0], torch.cuda.max_memory_allocated() - base


def main() -> None:
    cuda = torch.device("cuda")
    cases: list[tuple[str, Callable[[], nn.Module], Callable[[], tuple]]] = []
    for b, t, d, v in [(4, 64, 256, 16000), (8, 512, 1024, 32000), (2, 4096, 4096, 128256)]:
        cases.append((f"head {b}x{t} tokens, d={d}, vocab {v}", lambda d=d, v=v: Head(d, v),
                      lambda b=b, t=t, d=d, v=v: (torch.randn(b, t, d, device=cuda, requires_grad=True),
                                                  torch.randint(0, v, (b, t), device=cuda))))  # fmt: skip
    for b, t, d in [(4, 64, 256), (8, 512, 1024), (2, 2048, 4096)]:
        cases.append((f"encoder layer {b}x{t} tokens, d={d}", lambda d=d: Block(d),
                      lambda b=b, t=t, d=d: (torch.randn(b, t, d, device=cuda, requires_grad=True),)))  # fmt: skip
    rows = []
    for name, build, inputs in cases:
        for dtype in (None, torch.bfloat16):
            torch.manual_seed(0)
            model = build().to(cuda)
            gross, _ = measure(model, inputs, dtype, net=False)
            net, peak = measure(model, inputs, dtype, net=True)
            rows.append({"case": name, "autocast": str(dtype), "gross_mib": gross / MIB, "net_mib": net / MIB,
                         "cuda_peak_mib": peak / MIB})  # fmt: skip
            print(rows[-1], flush=True)
    RESULTS.mkdir(parents=True, exist_ok=True)
    result = {"benchmark": "transient_cuda", "machine": machine(), "device": torch.cuda.get_device_name(), "rows": rows}
    (RESULTS / "transient_cuda.json").write_text(json.dumps(result, indent=1))
    print("| case | autocast | CUDA's peak, MiB | net (counted) / CUDA | gross / CUDA |")
    print("| --- | --- | --- | --- | --- |")
    for r in rows:
        peak = r["cuda_peak_mib"]
        net, gross = r["net_mib"] / peak, r["gross_mib"] / peak
        print(f"| {r['case']} | {r['autocast']} | {peak:.1f} | {net:.2f} | {gross:.2f} |")


if __name__ == "__main__":
    main()
