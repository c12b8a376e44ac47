"""The same model trained with torch.distributed.pipelining directly, as PyTorch's tutorial does
(launch with torchrun).

    run_raw.py SCHEDULE M STEPS OUT [OPTIONS_JSON]

OPTIONS_JSON may name a ``shape`` of ``shapes.py`` (the GPT by default). ``interleaved_1f1b`` holds two stages per
rank, placed as the loop schedules place them (one rank: both stages, one GPU holding the pipeline). Writes the wall
times between consecutive step ends on rank 0, and every rank's minor page faults and system CPU seconds at each step
end."""

from __future__ import annotations

import json
import os
import sys
import time

import torch
import torch.distributed as dist
from common import ACCELERATOR, time_schedules, usage
from shapes import build, data, loss_of, stage_of
from torch.distributed.pipelining import PipelineStage, Schedule1F1B, ScheduleGPipe, ScheduleInterleaved1F1B

if __name__ == "__main__":
    schedule_name, m, steps, out = sys.argv[1], int(sys.argv[2]), int(sys.argv[3]), sys.argv[4]
    shape = (json.loads(sys.argv[5]) if len(sys.argv) > 5 else {}).get("shape", "gpt")
    cuda = ACCELERATOR == "cuda"
    dist.init_process_group("nccl" if cuda else "gloo")
    rank, world = dist.get_rank(), dist.get_world_size()
    device = torch.device("cuda", int(os.environ["LOCAL_RANK"])) if cuda else torch.device("cpu")
    per_rank = 2 if schedule_name == "interleaved_1f1b" else 1
    n_stages, indices = world * per_rank, [rank + world * k for k in range(per_rank)]
    models = [stage_of(build(shape), i, n_stages).to(device) for i in indices]  # the tutorial's manual split
    stages = [PipelineStage(model, i, n_stages, device) for model, i in zip(models, indices)]

    def loss_fn(out: torch.Tensor, target: torch.Tensor) -> torch.Tensor:
        return loss_of(models[-1], out, target)

    if per_rank == 1:
        schedule = {"gpipe": ScheduleGPipe, "1f1b": Schedule1F1B}[schedule_name](stages[0], m, loss_fn=loss_fn)
    else:
        schedule = ScheduleInterleaved1F1B(stages, m, loss_fn=loss_fn)
    optimizers = [model.configure_optimizers() for model in models]
    first, last = 0 in indices, n_stages - 1 in indices
    ends, faults = [], []
    time_schedules()
    for x, y in data(shape, steps):
        x, y = x.to(device), y.to(device)
        for optimizer in optimizers:
            optimizer.zero_grad()
        schedule.step(*([x] if first else []), **({"target": y} if last else {}))
        for optimizer in optimizers:
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
