"""``python -m lightning_pp.consolidate SRC DST [--format hf|peft]``: a checkpoint as one ordinary ``.ckpt``, as
a Hugging Face model directory, or as a peft adapter directory.

``--format ckpt`` (default): a sharded checkpoint directory as one file that loads with
``Module.load_from_checkpoint(DST)`` and resumes with ``ckpt_path=DST`` on one process, as a full checkpoint
written under the pipeline would. ``--format hf``: SRC (sharded or full) as safetensors shards with an index,
under the names the weights came in with (``init_weights``), with the ``transformers`` model's config, so
that ``AutoModelForCausalLM.from_pretrained(DST)`` returns the trained model; one shard in memory at a time; a
LoRA run's adapter (``--adapter``, default ``default``) merged into its base weights. ``--format peft``: that
adapter alone, as ``adapter_config.json`` and ``adapter_model.safetensors`` for
``PeftModel.from_pretrained(base, DST)``. An export that would leave out tensors the run trained stops, naming them.
From Python (after ``trainer.save_checkpoint``, on rank 0, with no process started): ``consolidate(src, dst)``,
``export_hf(src, dst)``, ``export_peft(src, dst)``.
"""

from __future__ import annotations

import argparse
import re
from pathlib import Path

import torch

from lightning_pp.checkpoints.export import export_hf, export_peft
from lightning_pp.checkpoints.formats import is_sharded, load_sharded
from lightning_pp.errors import PipelineConfigError

__all__ = ["consolidate", "export_hf", "export_peft"]


def consolidate(src: Path, dst: Path, weights_only: bool | None = None) -> Path:
    """``src`` checked and read without running code it carries, unless ``weights_only=False`` (``--trust``)."""
    if not is_sharded(src):
        raise SystemExit(f"{src} is not a sharded lightning-pp checkpoint (a directory with a meta.pt).")
    torch.save(load_sharded(src, weights_only), dst)
    return dst


def _size(text: str) -> int:
    """Bytes of ``5GB``, ``500MB``, ``40KB`` (powers of 1024, as ``save_pretrained``'s ``max_shard_size``)."""
    match = re.fullmatch(r"\s*([\d.]+)\s*([KMG]?)B?\s*", text.upper())
    if match is None:
        raise argparse.ArgumentTypeError(f"--max-shard-size={text!r}: give a size such as 5GB, 500MB or 40KB")
    return int(float(match[1]) * {"K": 2**10, "M": 2**20, "G": 2**30}.get(match[2], 1))


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("src", type=Path, help="a sharded checkpoint directory (or, with --format hf/peft, a .ckpt)")
    parser.add_argument("dst", type=Path, help="the .ckpt file to write, or the directory of the HF model or adapter")
    parser.add_argument("--format", choices=("ckpt", "hf", "peft"), default="ckpt")
    parser.add_argument("--max-shard-size", type=_size, default="5GB", help="per safetensors file (hf), e.g. 500MB")
    parser.add_argument("--adapter", default="default", help="the peft adapter to merge (hf) or write (peft)")
    parser.add_argument(
        "--trust", action="store_true", help="SRC is trusted: load objects of its own (torch.load weights_only=False)"
    )
    args = parser.parse_args()
    weights_only = False if args.trust else None
    try:
        if args.format == "hf":
            left_out = export_hf(args.src, args.dst, args.max_shard_size, args.adapter, weights_only)
            if left_out:
                print(f"left out (not part of the Hugging Face model): {', '.join(left_out)}")
        elif args.format == "peft":
            print(f"{len(export_peft(args.src, args.dst, args.adapter, weights_only))} adapter tensors")
        else:
            consolidate(args.src, args.dst, weights_only)
    except PipelineConfigError as error:
        raise SystemExit(f"consolidate --format {args.format}: {error}") from None
    print(f"wrote {args.dst}")


if __name__ == "__main__":
    main()
