"""The same model trained with torch.distributed.pipelining directly, as PyTorch's tutorial does
(launch with torchrun).

    run_raw.py SCHEDULE M STEPS OUT [OPTIONS_JSON]

OPTIONS_JSON may name a ``shape`` of ``shapes.py`` (the GPT by default). Writes the wall times between
consecutive step ends on rank 0, and every rank's minor page faults and system CPU seconds at each step end."""

from __future__ import annotations

import json
import os
import sys
import time

import torch
import torch.distributed as dist
from common import ACCELERATOR, usage
from shapes import build, data, loss_of, stage_of
from torch.distributed.pipelining import PipelineStage, Schedule1F1B, ScheduleGPipe

if __name__ == "__main__":
    schedule_name, m, steps, out = sys.argv[1], int(sys.argv[2]), int(sys.argv[3]), sys.argv[4]
    shape = (json.loads(sys.argv[5]) if len(sys.argv) > 5 else {}).get("shape", "gpt")
    cuda = ACCELERATOR == "cuda"
    dist.init_process_group("nccl" if cuda else "gloo")
    rank, world = dist.get_rank(), dist.get_world_size()
    device = torch.device("cuda", int(os.environ["LOCAL_RANK"])) if cuda else torch.device("cpu")
    model = stage_of(build(shape), rank, world).to(device)  # the tutorial's manual split
    stage = PipelineStage(model, rank, world, device)

    def loss_fn(out: torch.Tensor, target: torch.Tensor) -> torch.Tensor:
        return loss_of(model, out, target)

    schedule = {"gpipe": ScheduleGPipe, "1f1b": Schedule1F1B}[schedule_name](stage, m, loss_fn=loss_fn)
    optimizer = model.configure_optimizers()
    ends, faults = [], []
    for x, y in data(shape, steps):
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
        faults.append(usage())
    every: list = [None] * world
    dist.all_gather_object(every, faults)
    if rank == 0:
        with open(out, "w") as f:
            json.dump({"ends": ends, "faults": every}, f)
    dist.destroy_process_group()
