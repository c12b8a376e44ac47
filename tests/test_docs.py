"""The README's and docs/ pages' code runs: every ```python block is executed as a script of its own.

A block marked ```python fragment is an excerpt (part of a class, a Trainer that needs more devices than a
test machine has) and is only required to parse. Each runnable block runs in a fresh directory, as a user
would paste it into a file and run it. README's first block, and a block that says its other ranks re-run it
(it writes files before its Trainer for them to find), run with ``python``, so Lightning's launcher starts the
other ranks by re-running the file in fresh processes (the first process is forked from one that has imported
torch and Lightning: ``forked.py``). Every other block with a Trainer of ``devices=N`` runs as ``torchrun
--nproc_per_node N`` would run it, all N ranks forked: about 11 s of imports less for each rank on 2 cores.
"""

from __future__ import annotations

import ast
import re
from pathlib import Path

import pytest
from conftest import run_script
from models import transformers_at_least

ROOT = Path(__file__).resolve().parents[1]
PAGES = [ROOT / "README.md", *sorted((ROOT / "docs").glob("*.md"))]
_BLOCK = re.compile(r"^```python([^\n]*)\n(.*?)^```", re.S | re.M)


def _blocks(kind: str) -> list[tuple[str, str]]:
    found = []
    for page in PAGES:
        text = page.read_text()
        for match in _BLOCK.finditer(text):
            if match.group(1).strip() == kind:
                line = text.count("\n", 0, match.start()) + 1
                found.append((f"{page.relative_to(ROOT)}:{line}", match.group(2)))
    return found


def test_every_python_block_is_runnable_or_marked_a_fragment() -> None:
    infos = {m.group(1).strip() for page in PAGES for m in _BLOCK.finditer(page.read_text())}
    assert infos <= {"", "fragment"}, f"unknown markers {infos - {'', 'fragment'}}: use ```python or ```python fragment"
    assert _blocks(""), "no runnable block found: the docs would not be tested"


@pytest.mark.parametrize("where,code", _blocks("fragment"), ids=[w for w, _ in _blocks("fragment")])
def test_fragment_parses(where: str, code: str) -> None:
    ast.parse(code, filename=where)


_RUNNABLE = _blocks("")


def _ranks(where: str, code: str) -> int:
    """1 for a block run with ``python`` (its Lightning launcher starts the rest), else its Trainer's devices."""
    devices = {int(n) for n in re.findall(r"\bdevices=(\d+)", code)}
    if where == _RUNNABLE[0][0] or "re-runs this script" in code or len(devices) != 1:
        return 1
    return devices.pop()


@pytest.mark.parametrize("where,code", _RUNNABLE, ids=[w for w, _ in _RUNNABLE])
def test_block_runs(where: str, code: str, tmp_path: Path) -> None:
    if "output_router_logits=True" in code and not transformers_at_least(5, 23):
        pytest.skip("transformers < 5.23 counts the router's tokens with bincount: the trace is refused (test_moe.py)")
    script = tmp_path / "block.py"
    script.write_text(code)
    returncode, output = run_script(script, timeout=240, ranks=_ranks(where, code))
    assert returncode == 0, f"{where} failed:\n{output[-8000:]}"


def test_the_examples_a_page_shows_are_the_files() -> None:
    """A page that shows an example file shows it whole, so running the page's block runs the example."""
    shown = {"examples/finetune_hf.py": "docs/pretrained.md", "examples/finetune_lora.py": "docs/adapters.md",
             "examples/train_moe.py": "docs/models.md"}  # fmt: skip
    for example, page in shown.items():
        assert (ROOT / example).read_text() in (ROOT / page).read_text(), f"{page} no longer shows {example} as it is"
