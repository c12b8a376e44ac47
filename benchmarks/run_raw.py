"""The same GPT trained with torch.distributed.pipelining directly, as PyTorch's tutorial does
(launch with torchrun). Writes the wall times between consecutive step ends on rank 0."""

from __future__ import annotations

import json
import os
import sys
import time

import torch
import torch.distributed as dist
import torch.nn.functional as F
from common import ACCELERATOR, MODEL, batches
from torch.distributed.pipelining import PipelineStage, Schedule1F1B, ScheduleGPipe

from lightning_pp.examples.gpt import GPT

if __name__ == "__main__":
    schedule_name, m, steps, out = sys.argv[1], int(sys.argv[2]), int(sys.argv[3]), sys.argv[4]
    cuda = ACCELERATOR == "cuda"
    dist.init_process_group("nccl" if cuda else "gloo")
    rank, world = dist.get_rank(), dist.get_world_size()
    device = torch.device("cuda", int(os.environ["LOCAL_RANK"])) if cuda else torch.device("cpu")
    torch.manual_seed(0)
    model = GPT(**MODEL)
    per_stage = MODEL["n_layers"] // world
    for key in list(model.layers.keys()):  # the tutorial's manual split
        if int(key) // per_stage != rank:
            del model.layers[key]
    if rank != 0:
        model.tok_embeddings = None
    if rank != world - 1:
        model.norm, model.output = None, None
    model.to(device)
    stage = PipelineStage(model, rank, world, device)

    def loss_fn(logits: torch.Tensor, targets: torch.Tensor) -> torch.Tensor:
        return F.cross_entropy(logits.flatten(0, 1), targets.flatten())

    schedule = {"gpipe": ScheduleGPipe, "1f1b": Schedule1F1B}[schedule_name](stage, m, loss_fn=loss_fn)
    optimizer = torch.optim.AdamW(model.parameters(), lr=3e-3)
    ends = []
    for x, y in batches(steps):
        x, y = x.to(device), y.to(device)
        optimizer.zero_grad()
        if rank == 0:
            schedule.step(x)
        elif rank == world - 1:
            schedule.step(target=y)
        else:
            schedule.step()
        optimizer.step()
        if cuda:
            torch.cuda.synchronize(device)  # the step's kernels done, not only launched
        ends.append(time.perf_counter())
    if rank == 0:
        with open(out, "w") as f:
            json.dump({"ends": ends}, f)
    dist.destroy_process_group()
