"""``scripts/gpu_check.sh`` must run in one call on a stock GPU image that reaches no package index: what the GPU
checks import is either on that image (``scripts/gpu_image.txt``) or among the wheels ``scripts/gpu_wheels.sh``
fetches beforehand (``scripts/gpu_wheels.txt``). Checked here without a GPU, from the imports themselves."""

from __future__ import annotations

import ast
import re
import subprocess
import sys
from importlib.metadata import packages_distributions, requires
from pathlib import Path

import pytest
import torch
from packaging.requirements import Requirement
from conftest import child_env

ROOT = Path(__file__).parent.parent
SCRIPTS = ROOT / "scripts"


def _names(path: Path) -> set[str]:
    """Distribution names in a list file, normalised as pip compares them."""
    lines = (line.strip() for line in path.read_text().splitlines())
    return {_normal(line) for line in lines if line and not line.startswith("#")}


def _normal(name: str) -> str:
    return re.sub(r"[-_.]+", "-", name).lower()


def _local(name: str) -> Path | None:
    """The file of a module the checks import from this checkout (the package, the tests' and benchmarks' helpers)."""
    parts = name.split(".")
    if parts[0] == "lightning_pp":
        base = ROOT.joinpath(*parts)
        for candidate in (base.with_suffix(".py"), base / "__init__.py"):
            if candidate.exists():
                return candidate
        return None
    for folder in ("tests", "benchmarks"):
        candidate = ROOT / folder / f"{parts[0]}.py"
        if len(parts) == 1 and candidate.exists():
            return candidate
    return None


def _third_party(starts: list[Path]) -> set[str]:
    """Top-level modules outside the standard library and this checkout that ``starts`` import, followed through
    this checkout's own modules (imports inside functions included: a lazily imported module is imported too)."""
    seen: set[Path] = set()
    found: set[str] = set()
    todo = list(starts)
    while todo:
        path = todo.pop()
        if path in seen:
            continue
        seen.add(path)
        for node in ast.walk(ast.parse(path.read_text())):
            if isinstance(node, ast.Import):
                modules = [alias.name for alias in node.names]
            elif isinstance(node, ast.ImportFrom) and node.level == 0 and node.module:
                modules = [node.module] + [f"{node.module}.{alias.name}" for alias in node.names]
            else:
                continue
            for module in modules:
                local = _local(module)
                if local is not None:
                    todo.append(local)
                elif module.split(".")[0] not in {*sys.stdlib_module_names, "__main__", "lightning_pp"}:
                    if _local(module.split(".")[0]) is None:
                        found.add(module.split(".")[0])
    return found


def _checked_files() -> list[Path]:
    """What gpu_check.sh runs: the GPU tests, the job scripts their ranks run, the benchmarks and their rank scripts."""
    script = (SCRIPTS / "gpu_check.sh").read_text()
    benchmarks = {ROOT / p for p in re.findall(r"benchmarks/\w+\.py", script)}
    runs = set((ROOT / "benchmarks").glob("run_*.py"))
    jobs = [ROOT / "tests" / name for name in ("test_gpu.py", "job.py", "forked.py", "conftest.py")]
    return sorted(set(jobs) | benchmarks | runs)


# imported only when asked for, by what no GPU check runs: fault_tolerance (lightning_pp.replicas). torchft's wheel
# carries a compiled extension for one Python, so no wheel of this machine's would serve the image's.
NOT_ON_THE_GPU = {"torchft"}


def test_what_the_gpu_checks_import_is_on_the_image_or_among_the_wheels():
    image, wheels = _names(SCRIPTS / "gpu_image.txt"), _names(SCRIPTS / "gpu_wheels.txt")
    assert not image & wheels, f"already on the image, no wheel needed: {sorted(image & wheels)}"
    assert {"torch", "lightning", "transformers", "peft", "pytest", "pytest-timeout"} <= image
    distributions = packages_distributions()
    modules = _third_party(_checked_files())
    assert {"torch", "lightning", "hydra", "torchdata", "transformers"} <= modules  # the walk reaches the jobs
    lacking = {}
    imported = subprocess.run([sys.executable, "-c", "import sys, lightning_pp; print(sorted(sys.modules))"],
                              capture_output=True, text=True, check=True).stdout  # fmt: skip
    assert not any(f"'{module}'" in imported for module in NOT_ON_THE_GPU)  # not at import: only when asked for
    for module in sorted(modules - NOT_ON_THE_GPU):
        names = {_normal(d) for d in distributions.get(module, [module])}
        if not names & (image | wheels):
            lacking[module] = sorted(names)
    assert not lacking, f"imported by the GPU checks, on neither the image nor gpu_wheels.txt: {lacking}"
    # each wheel's own requirements are met there too (pip install --no-index fails on a missing one)
    for wheel in sorted(wheels):
        for requirement in map(Requirement, requires(wheel) or []):
            if requirement.marker is not None and not requirement.marker.evaluate({"extra": ""}):
                continue  # an extra's, or an old Python's
            name = _normal(requirement.name)
            assert name in image | wheels, f"{wheel} needs {name}, on neither the image nor gpu_wheels.txt"
    # the package's own requirements
    pyproject = (ROOT / "pyproject.toml").read_text()
    listed = re.search(r"dependencies = \[(.*?)\]", pyproject, re.S).group(1)
    for requirement in re.findall(r'"([A-Za-z0-9_.-]+)', listed):
        assert _normal(requirement) in image | wheels, requirement


@pytest.mark.skipif(torch.cuda.is_available(), reason="this machine has a CUDA device: gpu_check.sh would run")
def test_gpu_check_without_a_gpu_exits_with_its_one_line_reason(tmp_path):
    env = {**child_env(), "PYTHON": sys.executable}
    proc = subprocess.run(
        ["bash", str(SCRIPTS / "gpu_check.sh"), str(tmp_path / "out")], env=env, capture_output=True, text=True
    )
    assert proc.returncode == 1, proc.stderr
    assert proc.stdout == ""
    assert proc.stderr.count("\n") == 1 and proc.stderr.startswith(f"gpu_check: torch {torch.__version__} sees no CUDA")
    assert not (tmp_path / "out").exists()  # nothing written, nothing installed


def test_gpu_check_without_the_wheels_it_needs_says_how_to_fetch_them(tmp_path):
    # a Python that reports a GPU (torch.cuda.device_count()) and sees no installed distribution (-S: no
    # site-packages), as a stock image lacks hydra-core: the script stops before any test, saying what to do
    fake = tmp_path / "python"
    fake.write_text(
        f'#!/usr/bin/env bash\nif [ "$1" = "-c" ]; then echo 1; exit 0; fi\nexec {sys.executable} -S "$@"\n'
    )
    fake.chmod(0o755)
    env = {**child_env(), "PYTHON": str(fake), "GPU_WHEELS": str(tmp_path / "none")}
    env = {k: v for k, v in env.items() if k != "PYTHONPATH"}
    proc = subprocess.run(
        ["bash", str(SCRIPTS / "gpu_check.sh"), str(tmp_path / "out")], env=env, capture_output=True, text=True
    )
    assert proc.returncode == 1, proc.stderr
    assert "holds no wheels: run bash scripts/gpu_wheels.sh DIR" in proc.stderr, proc.stderr
    assert "lacks hydra-core omegaconf" in proc.stderr
    assert not (tmp_path / "out").exists()
