#!/usr/bin/env bash
# The CUDA checks in one call, on whatever NVIDIA GPUs this machine has and the torch it has (2.11 to 2.15):
#   bash scripts/gpu_check.sh [OUT]        (OUT: benchmarks/results/gpu by default)
# A stock CUDA image (scripts/gpu_image.txt) reaches no package index: what the checks import and it lacks is
# installed from wheels fetched beforehand where an index is reachable (bash scripts/gpu_wheels.sh DIR, carried to
# the machine as DIR; GPU_WHEELS=DIR, .whl by default) with pip install --no-index --find-links. The package runs
# from this checkout (PYTHONPATH); nothing else is installed, torch least of all.
# Runs tests/test_gpu.py (docs/development.md's table: each skips, saying why, where the machine has too few GPUs),
# the planner's count of a backward's memory against CUDA's allocator, then the benchmarks: the strategy's step over
# raw torch pipelining's, compile over eager on 1024-wide blocks, the device-to-host syncs of a steady step (on one
# GPU, both stages on it under interleaved 1F1B; on 2+, 1F1B and GPipe over two, and the schedules).
# Writes OUT/tests.xml (JUnit: what passed, failed, skipped), OUT/transient_cuda.json, OUT/overhead.json,
# OUT/compiled.json, OUT/syncs.json (OUT/schedules.json on 2+ GPUs) and OUT/versions.txt (GPU, driver, torch and
# the packages used). About 8 minutes on one H100/H200 (not yet timed: see docs/development.md's table of runs).
# Python: $PYTHON, else .venv/bin/python where scripts/setup.sh made one, else python3.
set -euo pipefail
cd "$(dirname "$0")/.."
out="$(realpath -m "${1:-benchmarks/results/gpu}")"
python="${PYTHON:-}"
if [ -z "$python" ]; then
    if [ -x .venv/bin/python ]; then python=.venv/bin/python; else python=python3; fi
fi
gpus="$("$python" -c 'import torch; print(torch.cuda.device_count())')"
if [ "$gpus" -lt 1 ]; then
    echo "gpu_check: torch $("$python" -c 'import torch; print(torch.__version__)') sees no CUDA device: run it on a" \
        "machine with an NVIDIA GPU" >&2
    exit 1
fi
wheels="${GPU_WHEELS:-.whl}"
# shellcheck disable=SC2046
missing="$("$python" - $(grep -v '^#' scripts/gpu_wheels.txt) <<'PY'
import sys
from importlib.metadata import PackageNotFoundError, version

def absent(name):
    try:
        version(name)
    except PackageNotFoundError:
        return True
    return False

print(" ".join(name for name in sys.argv[1:] if absent(name)))
PY
)"
if [ -n "$missing" ]; then
    if ! ls "$wheels"/*.whl > /dev/null 2>&1; then
        echo "gpu_check: this Python lacks $missing and $wheels holds no wheels: run bash scripts/gpu_wheels.sh DIR" \
            "where a package index is reachable, bring DIR here and set GPU_WHEELS=DIR" >&2
        exit 1
    fi
    # shellcheck disable=SC2086
    "$python" -m pip install --quiet --disable-pip-version-check --no-index --find-links "$wheels" $missing
fi
export PYTHONPATH="$PWD${PYTHONPATH:+:$PYTHONPATH}"
# the checks start their own ranks: a SLURM allocation's variables would have Lightning wait for ranks SLURM starts
for name in $(compgen -v SLURM_); do unset "$name"; done
mkdir -p "$out"
{
    nvidia-smi -L || true
    nvidia-smi --query-gpu=driver_version --format=csv,noheader || true
    "$python" - <<'PY'
import sys
from importlib.metadata import version

import torch

print(f"python {sys.version.split()[0]}, torch {torch.__version__} (CUDA {torch.version.cuda}, NCCL"
      f" {'.'.join(map(str, torch.cuda.nccl.version()))})")
for name in ("lightning", "transformers", "peft", "torchmetrics", "triton", "hydra-core", "torchdata"):
    print(name, version(name))
PY
} | tee "$out/versions.txt"
status=0
"$python" -m pytest -q -rs -p no:cacheprovider -m gpu tests/test_gpu.py --junitxml "$out/tests.xml" || status=$?
export BENCH_ACCELERATOR=cuda BENCH_RESULTS="$out"
"$python" benchmarks/transient_cuda.py || status=$?
if [ "$gpus" -ge 2 ]; then
    "$python" benchmarks/overhead.py --schedules gpipe,1f1b --rounds 3 || status=$?
    "$python" benchmarks/schedules.py || status=$?
    "$python" benchmarks/compiled.py --shapes encoder_1024,gpt --rounds 1 || status=$?
    "$python" benchmarks/syncs.py --ranks 2 --schedules 1f1b,gpipe || status=$?
else  # one GPU holds both stages (interleaved 1F1B), for the strategy and for raw torch alike
    "$python" benchmarks/overhead.py --ranks 1 --schedules interleaved_1f1b --shapes gpt --rounds 3 || status=$?
    "$python" benchmarks/compiled.py --ranks 1 --schedule interleaved_1f1b --shapes encoder_1024 --rounds 1 \
        || status=$?
    "$python" benchmarks/syncs.py --ranks 1 --schedules interleaved_1f1b || status=$?
fi
exit "$status"
