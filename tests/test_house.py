"""The package's structure: wings below the strategy, each importing only the wings below it.

Read from the source (every import statement, also those inside functions), so a new import that runs
back up a wing, or a wing that imports more than its docstring says, fails here.
"""

from __future__ import annotations

import ast
import re
from pathlib import Path

PACKAGE = Path(__file__).resolve().parents[1] / "lightning_pp"
# bottom to top: a wing may import only wings to its left
ORDER = [
    "errors",
    "compat",
    "layout",
    "lifecycle",
    "memory",
    "checkpoints",
    "split",
    "runtime",
    "choose",
    "holding",
    "generation",
    "replicas",
    "strategy",
    "callbacks",
    "consolidate",
    "train",
    "plan",
    "__init__",
]
DATA = {"conf", "examples"}  # Hydra configs and example modules: no part of the layering


def _module_name(path: Path) -> str:
    parts = path.relative_to(PACKAGE.parent).with_suffix("").parts
    return ".".join(parts[:-1] if parts[-1] == "__init__" else parts)


def _imports(path: Path) -> set[str]:
    """Every ``lightning_pp`` module this file imports, relative imports resolved."""
    package = _module_name(path) if path.name == "__init__.py" else _module_name(path).rpartition(".")[0]
    found: set[str] = set()
    for node in ast.walk(ast.parse(path.read_text())):
        if isinstance(node, ast.Import):
            found |= {a.name for a in node.names if a.name.startswith("lightning_pp")}
        elif isinstance(node, ast.ImportFrom):
            base = node.module or ""
            if node.level:
                base = ".".join(
                    package.split(".")[: len(package.split(".")) - node.level + 1] + ([base] if base else [])
                )
            if base.startswith("lightning_pp"):
                found |= {base} | {f"{base}.{a.name}" for a in node.names}
    return {m for m in found if _exists(m)}


def _exists(module: str) -> bool:
    path = PACKAGE.parent.joinpath(*module.split("."))
    return path.with_suffix(".py").exists() or (path / "__init__.py").exists()


def _wing(module: str) -> str:
    parts = module.split(".")
    return "__init__" if len(parts) == 1 else parts[1]


def _graph() -> dict[str, set[str]]:
    return {_module_name(p): _imports(p) for p in PACKAGE.rglob("*.py") if _wing(_module_name(p)) not in DATA}


def test_top_level_holds_the_strategy_errors_torch_shims_and_wings() -> None:
    modules = {p.stem for p in PACKAGE.glob("*.py")}
    wings = {p.name for p in PACKAGE.iterdir() if (p / "__init__.py").exists()} - DATA
    assert modules == {"__init__", "errors", "compat", "strategy", "callbacks", "consolidate"}
    assert modules | wings == set(ORDER)


def test_no_import_runs_up_a_wing() -> None:
    upward = [
        f"{module} -> {dep}"
        for module, deps in _graph().items()
        for dep in deps
        if _wing(dep) not in DATA and ORDER.index(_wing(dep)) > ORDER.index(_wing(module))
    ]
    assert not upward


def test_each_wing_says_what_it_is_for_and_what_it_imports() -> None:
    graph = _graph()
    for wing in ORDER:
        init = PACKAGE / wing / "__init__.py"
        if not init.exists():
            continue
        doc = ast.get_docstring(ast.parse(init.read_text())) or ""
        said = re.search(r"Imports:(.*)", doc, re.S)
        assert doc and said, f"{init}: a docstring that says what the wing is for and ends with 'Imports: ...'"
        declared = set(re.findall(r"``(\w+)``", said.group(1))) | {"errors", "compat", wing}
        if "strategy" in said.group(1):
            declared.add("strategy")
        used = {_wing(d) for m, deps in graph.items() if _wing(m) == wing for d in deps} - DATA
        assert used <= declared, f"{wing} imports {sorted(used - declared)}, which its docstring does not name"


def test_modules_import_no_cycle() -> None:
    graph, state = _graph(), {}

    def visit(module: str, path: list[str]) -> None:
        if state.get(module) == "done":
            return
        assert state.get(module) != "open", " -> ".join([*path, module])
        state[module] = "open"
        for dep in graph.get(module, ()):
            if dep != module and not module.startswith(dep + "."):  # a package's own __init__ is not a cycle
                visit(dep, [*path, module])
        state[module] = "done"

    for module in graph:
        visit(module, [])
