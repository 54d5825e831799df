"""How the package installs: every third-party module the code imports is declared,
requirements are ranges, ``make`` installs the tested pins within them, and install hints
name what exists (the package is installed from the checkout, not from an index)."""

from __future__ import annotations

import ast
import re
import sys
import tomllib
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]
SRC = ROOT / "src" / "chameleon_ft"
DISTRIBUTION = {"yaml": "pyyaml"}
"""Import names whose distribution is named otherwise."""
IMPLIED = {"tensorboard": "tensorboard"}
"""Modules imported through another (``torch.utils.tensorboard`` needs ``tensorboard``)."""


def _requirements() -> dict[str, list[str]]:
    """Every declared requirement, by distribution name (lower case)."""
    project = tomllib.loads((ROOT / "pyproject.toml").read_text())["project"]
    out: dict[str, list[str]] = {}
    for req in [*project["dependencies"],
                *(r for reqs in project["optional-dependencies"].values() for r in reqs)]:
        name = re.match(r"[A-Za-z0-9_.-]+", req)
        assert name is not None, req
        out.setdefault(name.group(0).lower(), []).append(req)
    return out


def _third_party_imports(folder: Path) -> set[str]:
    names: set[str] = set()
    for path in folder.rglob("*.py"):
        tree = ast.parse(path.read_text(encoding="utf-8"))
        for node in ast.walk(tree):
            if isinstance(node, ast.Import):
                names.update(a.name for a in node.names)
            elif isinstance(node, ast.ImportFrom) and node.module and node.level == 0:
                names.add(node.module)
    tops = {n.split(".")[0] for n in names} | {IMPLIED[n.split(".")[-1]] for n in names
                                               if n.split(".")[-1] in IMPLIED}
    return {t for t in tops if t not in sys.stdlib_module_names and t != "chameleon_ft"}


@pytest.mark.parametrize("folder", ["src/chameleon_ft", "examples"])
def test_every_imported_package_is_declared(folder: str) -> None:
    declared = _requirements()
    local = {p.stem for p in (ROOT / "examples").glob("*.py")}  # the examples' own modules
    missing = {DISTRIBUTION.get(m, m) for m in _third_party_imports(ROOT / folder)} \
        - set(declared) - local
    assert not missing, f"imported but not declared in pyproject.toml: {sorted(missing)}"


def test_requirements_are_ranges_and_the_tested_pins_lie_within() -> None:
    specifiers = pytest.importorskip("packaging.specifiers")
    declared = _requirements()
    for name, reqs in declared.items():
        assert not any("==" in r for r in reqs), f"{name} is pinned in pyproject: {reqs}"
    (torch,) = declared["torch"]
    assert torch == "torch>=2.13,<2.16"
    pins = dict(line.split("==") for line in (ROOT / "constraints.txt").read_text().splitlines()
                if line and not line.startswith("#"))
    assert pins["torch"] == "2.13.0"
    for name, version in pins.items():
        for req in declared.get(name.lower(), []):
            spec = specifiers.SpecifierSet(req[len(name):].split(";")[0])
            assert version in spec, f"constraints.txt pins {name}=={version} outside {req}"
    makefile = (ROOT / "Makefile").read_text()
    assert re.search(r"pip install .*-c constraints\.txt", makefile)


def test_install_hints_name_the_checkout() -> None:
    texts = [p.read_text(encoding="utf-8") for p in [ROOT / "README.md", *SRC.rglob("*.py")]]
    for text in texts:
        # `pip install chameleon-ft[...]` would look for a package no index publishes
        assert not re.search(r"pip install '?chameleon-ft", text)
