"""Architecture guards: the planning core stays pure, and the CLI's flags stay put."""

from __future__ import annotations

import ast
import subprocess
import sys
from pathlib import Path

import pytest

PACKAGE = Path(__file__).resolve().parents[2] / "src" / "chameleon_ft"
PURE = ("spec", "profile", "plan", "perf", "recovery", "policy", "sim", "failures")


def _modules(path: Path) -> set[str]:
    """Every module ``path`` imports, by its full dotted name."""
    tree = ast.parse(path.read_text(encoding="utf-8"))
    out: set[str] = set()
    for node in ast.walk(tree):
        if isinstance(node, ast.Import):
            out.update(alias.name for alias in node.names)
        elif isinstance(node, ast.ImportFrom) and node.module and node.level == 0:
            out.add(node.module)
    return out


def _imports(path: Path) -> set[str]:
    return {name.split(".")[0] for name in _modules(path)}


@pytest.mark.parametrize("package", PURE)
def test_pure_core_never_imports_torch(package: str) -> None:
    for path in sorted((PACKAGE / package).rglob("*.py")):
        assert "torch" not in _imports(path), f"{path.relative_to(PACKAGE)} imports torch"


def test_only_runtime_and_its_commands_import_torch() -> None:
    allowed = {"runtime"}
    for path in sorted(PACKAGE.rglob("*.py")):
        rel = path.relative_to(PACKAGE)
        if rel.parts[0] in allowed or rel.parts[0] == "cli":
            continue  # cli modules import torch lazily inside run(); checked below
        assert "torch" not in _imports(path), f"{rel} imports torch"


def test_importing_the_core_and_the_cli_loads_no_torch() -> None:
    code = (
        "import sys\n"
        "import chameleon_ft.cli, chameleon_ft.spec, chameleon_ft.profile, chameleon_ft.plan\n"
        "import chameleon_ft.perf\n"
        "for name in ('recovery', 'policy', 'sim'):\n"
        "    try:\n"
        "        __import__('chameleon_ft.' + name)\n"
        "    except ModuleNotFoundError:\n"
        "        pass\n"
        "from chameleon_ft.cli import estimate_cmd\n"
        "assert 'torch' not in sys.modules, 'torch was imported'\n"
    )
    result = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True,
                            timeout=60, check=False)
    assert result.returncode == 0, result.stderr


def test_the_runtime_imports_nothing_from_the_simulator() -> None:
    """The trace format lives below both (``chameleon_ft.failures``); the runtime never
    reaches into the simulator."""
    for path in sorted((PACKAGE / "runtime").rglob("*.py")):
        sim = {m for m in _modules(path) if m == "chameleon_ft.sim"
               or m.startswith("chameleon_ft.sim.")}
        assert not sim, f"{path.relative_to(PACKAGE)} imports {sorted(sim)}"
