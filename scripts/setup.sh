#!/usr/bin/env bash
# Creates .venv and installs lightning-pp with the pinned CPU build of torch.
set -euo pipefail
cd "$(dirname "$0")/.."
if [ ! -x .venv/bin/python ]; then
    python3 -m venv .venv
fi
.venv/bin/python -m pip install --quiet --disable-pip-version-check -c constraints.txt -e ".[test,examples,slurm,cli,ft]"
