"""t1: one process, one thread, running the same m micro-batches one after another (accumulating),
then the optimizer step. Writes the step end times."""

from __future__ import annotations

import json
import sys
import time

import torch
import torch.nn.functional as F
from common import MODEL, batches

from lightning_pp.examples.gpt import GPT

if __name__ == "__main__":
    m, steps, out = int(sys.argv[1]), int(sys.argv[2]), sys.argv[3]
    torch.set_num_threads(1)
    torch.manual_seed(0)
    model = GPT(**MODEL)
    optimizer = torch.optim.AdamW(model.parameters(), lr=3e-3)
    ends = []
    for x, y in batches(steps):
        optimizer.zero_grad()
        for xm, ym in zip(x.chunk(m), y.chunk(m)):
            (F.cross_entropy(model(xm).flatten(0, 1), ym.flatten()) / m).backward()
        optimizer.step()
        ends.append(time.perf_counter())
    with open(out, "w") as f:
        json.dump({"ends": ends}, f)
