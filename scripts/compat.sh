#!/usr/bin/env bash
# The whole suite under another torch release, in an environment of its own beside .venv:
#   bash scripts/compat.sh 2.11.0 [pytest arguments]
#   TRANSFORMERS=5.17.0 bash scripts/compat.sh 2.11.0 [pytest arguments]    (another transformers too)
# PyPI's builds of torch 2.11.0, 2.12.1, 2.14.1 and 2.15.0 are CUDA builds of several GB; they run on the CPU. Every
# other package keeps the version constraints.txt pins; CI keeps torch 2.13.0 (the CPU build, scripts/setup.sh).
set -euo pipefail
cd "$(dirname "$0")/.."
version="${1:?usage: [TRANSFORMERS=VERSION] bash scripts/compat.sh TORCH_VERSION [pytest arguments]}"
shift
transformers="${TRANSFORMERS:-}"
venv=".venv-torch$version${transformers:+-transformers$transformers}"
if [ ! -x "$venv/bin/python" ]; then
    python3 -m venv "$venv"
fi
drop='^torch=='
if [ -n "$transformers" ]; then drop='^torch==\|^transformers=='; fi
grep -v "$drop" constraints.txt > "$venv/constraints.txt"
"$venv/bin/python" -m pip install --quiet --disable-pip-version-check -c "$venv/constraints.txt" \
    "torch==$version" ${transformers:+"transformers==$transformers"} -e ".[test,examples,slurm,cli,ft]"
"$venv/bin/python" -c "import sys, torch; v = torch.__version__.split('+')[0]; sys.exit(v != '$version' and f'torch {v} installed, not $version')"
exec "$venv/bin/python" -m pytest -q "$@"
