#!/usr/bin/env bash
# The CUDA checks, on whatever NVIDIA GPUs this machine has:
#   bash scripts/gpu_check.sh [OUT]        (OUT: benchmarks/results/gpu by default)
# Runs tests/test_gpu.py (NCCL between stages, stages materialised on their device, FSDP2 inside stages,
# fp16 with the CUDA GradScaler, bf16-mixed, 2BW, CUDA-event telemetry; each skips, saying why, where the
# machine has too few GPUs), then the overhead, schedule and compile benchmarks on 2 GPUs (on one, the compile
# benchmark alone, both stages on it), and the planner's count of a backward's memory against CUDA's allocator.
# Writes OUT/tests.xml (JUnit: what passed, failed, skipped), OUT/overhead_*.json, OUT/schedules.json,
# OUT/compiled.json and OUT/transient_cuda.json.
# Uses .venv (scripts/setup.sh), or the Python in $PYTHON: a CUDA build of torch is needed.
set -euo pipefail
cd "$(dirname "$0")/.."
out="$(realpath -m "${1:-benchmarks/results/gpu}")"
python="${PYTHON:-.venv/bin/python}"
mkdir -p "$out"
gpus="$("$python" -c 'import torch; print(torch.cuda.device_count())')"
if [ "$gpus" -lt 1 ]; then
    echo "gpu_check: torch $("$python" -c 'import torch; print(torch.__version__)') sees no CUDA device" >&2
    exit 1
fi
nvidia-smi -L || true
status=0
"$python" -m pytest -q -rs -m gpu tests/test_gpu.py --junitxml "$out/tests.xml" || status=$?
BENCH_RESULTS="$out" "$python" benchmarks/transient_cuda.py || status=$?
if [ "$gpus" -ge 2 ]; then
    export BENCH_ACCELERATOR=cuda BENCH_RESULTS="$out"
    for schedule in gpipe 1f1b; do
        "$python" benchmarks/overhead.py --schedule "$schedule" --rounds 3
        mv "$out/overhead.json" "$out/overhead_$schedule.json"
    done
    "$python" benchmarks/schedules.py
    "$python" benchmarks/compiled.py
else
    echo "gpu_check: the overhead and schedule benchmarks need 2 GPUs; this machine has $gpus: compile is timed" \
        "with both stages on one" >&2
    BENCH_ACCELERATOR=cuda BENCH_RESULTS="$out" "$python" benchmarks/compiled.py --ranks 1 --schedule interleaved_1f1b
fi
exit "$status"
