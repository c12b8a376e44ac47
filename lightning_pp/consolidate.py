"""``python -m lightning_pp.consolidate SRC DST``: a sharded checkpoint directory as one ordinary ``.ckpt``.

The result loads with ``Module.load_from_checkpoint(DST)`` and resumes with ``ckpt_path=DST`` on one
process, as a full checkpoint written under the pipeline would.
"""

from __future__ import annotations

import argparse
from pathlib import Path

import torch

from lightning_pp.checkpoints.formats import is_sharded, load_sharded


def consolidate(src: Path, dst: Path) -> Path:
    if not is_sharded(src):
        raise SystemExit(f"{src} is not a sharded lightning-pp checkpoint (a directory with a meta.pt).")
    torch.save(load_sharded(src), dst)
    return dst


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("src", type=Path, help="sharded checkpoint directory")
    parser.add_argument("dst", type=Path, help="the .ckpt file to write")
    args = parser.parse_args()
    print(f"wrote {consolidate(args.src, args.dst)}")


if __name__ == "__main__":
    main()
