#!/usr/bin/env bash
# The wheels scripts/gpu_check.sh installs on a GPU machine that reaches no package index, fetched here:
#   bash scripts/gpu_wheels.sh [DIR]        (DIR: .whl by default; about 1.5 MB)
# What a stock CUDA image (torch, Lightning, transformers, peft, pytest there; scripts/gpu_image.txt) lacks of what
# the GPU checks import: the distributions scripts/gpu_wheels.txt names, each at the version .venv (or $PYTHON)
# holds, the one the suite passes with. All are pure Python, so one wheel serves whichever Python the image has;
# antlr4's runtime is published as a source archive and is built into a wheel here. No torch: the image's own runs.
set -euo pipefail
cd "$(dirname "$0")/.."
dir="${1:-.whl}"
python="${PYTHON:-.venv/bin/python}"
names="$(grep -v '^#' scripts/gpu_wheels.txt)"
# shellcheck disable=SC2086
pins="$("$python" -c 'import sys; from importlib.metadata import version
print(" ".join(f"{n}=={version(n)}" for n in sys.argv[1:]))' $names)"
mkdir -p "$dir"
# shellcheck disable=SC2086
"$python" -m pip wheel --quiet --disable-pip-version-check --no-deps --wheel-dir "$dir" $pins
echo "gpu_wheels: $pins in $dir"
