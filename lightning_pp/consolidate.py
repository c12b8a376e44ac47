"""``python -m lightning_pp.consolidate SRC DST [--format hf]``: a checkpoint as one ordinary ``.ckpt``, or
as a Hugging Face model directory.

``--format ckpt`` (default): a sharded checkpoint directory as one file that loads with
``Module.load_from_checkpoint(DST)`` and resumes with ``ckpt_path=DST`` on one process, as a full checkpoint
written under the pipeline would. ``--format hf``: SRC (sharded or full) as safetensors shards with an index,
under the names the weights came in with (``init_weights``), with the ``transformers`` model's config, so
that ``AutoModelForCausalLM.from_pretrained(DST)`` returns the trained model; one shard in memory at a time.
"""

from __future__ import annotations

import argparse
import re
from pathlib import Path

import torch

from lightning_pp.checkpoints.export import export_hf
from lightning_pp.checkpoints.formats import is_sharded, load_sharded


def consolidate(src: Path, dst: Path) -> Path:
    if not is_sharded(src):
        raise SystemExit(f"{src} is not a sharded lightning-pp checkpoint (a directory with a meta.pt).")
    torch.save(load_sharded(src), dst)
    return dst


def _size(text: str) -> int:
    """Bytes of ``5GB``, ``500MB``, ``40KB`` (powers of 1024, as ``save_pretrained``'s ``max_shard_size``)."""
    match = re.fullmatch(r"\s*([\d.]+)\s*([KMG]?)B?\s*", text.upper())
    if match is None:
        raise argparse.ArgumentTypeError(f"--max-shard-size={text!r}: give a size such as 5GB, 500MB or 40KB")
    return int(float(match[1]) * {"K": 2**10, "M": 2**20, "G": 2**30}.get(match[2], 1))


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("src", type=Path, help="a sharded checkpoint directory (or, with --format hf, a .ckpt)")
    parser.add_argument("dst", type=Path, help="the .ckpt file to write, or the directory of the HF model")
    parser.add_argument("--format", choices=("ckpt", "hf"), default="ckpt")
    parser.add_argument("--max-shard-size", type=_size, default="5GB", help="per safetensors file (hf), e.g. 500MB")
    args = parser.parse_args()
    if args.format == "hf":
        left_out = export_hf(args.src, args.dst, args.max_shard_size)
        if left_out:
            print(f"left out (not part of the Hugging Face model): {', '.join(left_out)}")
        print(f"wrote {args.dst}")
    else:
        print(f"wrote {consolidate(args.src, args.dst)}")


if __name__ == "__main__":
    main()
