"""The import layering written down in docs/ARCHITECTURE.md ("Layering") holds in the code.

The document lists each package's modules in layers, top first; a module may import only modules on lower
lines, and neither half imports the other. Every module must be on exactly one line, so a new module is placed
on purpose. Subpackages are walked too: `training.model` (its `__init__.py`) and `training.model.drafter` are
modules of their own, each on its line.
"""

from __future__ import annotations

import ast
import re
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[1]
PACKAGES = ("gpuctl", "training")


def documented_layers() -> dict[str, list[list[str]]]:
    text = (REPO / "docs" / "ARCHITECTURE.md").read_text()
    layers: dict[str, list[list[str]]] = {}
    for package, body in re.findall(r"```layers (\w+)\n(.*?)```", text, re.DOTALL):
        layers[package] = [line.split() for line in body.splitlines() if line.strip()]
    return layers


def module_name(path: Path) -> str:
    parts = path.relative_to(REPO).with_suffix("").parts
    return ".".join(parts[:-1]) if parts[-1] == "__init__" else ".".join(parts)


def imported_modules(path: Path, known: set[str]) -> set[str]:
    """The project modules a file imports, wherever the import statement stands (lazy ones included)."""
    found = set()
    for node in ast.walk(ast.parse(path.read_text())):
        if isinstance(node, ast.Import):
            names = [alias.name for alias in node.names]
        elif isinstance(node, ast.ImportFrom) and node.module and node.level == 0:
            # `from gpuctl import ssh` imports the module gpuctl.ssh; `from gpuctl.ssh import X` the module.
            names = [f"{node.module}.{alias.name}" if f"{node.module}.{alias.name}" in known else node.module
                     for alias in node.names]
        else:
            continue
        for name in names:
            while name and name not in known and "." in name:
                name = name.rsplit(".", 1)[0]
            if name.split(".")[0] in PACKAGES:
                found.add(name)
    return found


def test_architecture_lists_every_module_once():
    layers = documented_layers()
    assert set(layers) == set(PACKAGES)
    for package in PACKAGES:
        listed = [m for line in layers[package] for m in line]
        actual = sorted(module_name(p) for p in (REPO / package).rglob("*.py"))
        assert sorted(listed) == actual, f"docs/ARCHITECTURE.md's {package} layers and {package}/*.py differ"


@pytest.mark.parametrize("package", PACKAGES)
def test_modules_import_only_lower_layers(package):
    layers = documented_layers()
    rank = {m: i for p in PACKAGES for i, line in enumerate(reversed(layers[p])) for m in line}
    known = set(rank)
    wrong = []
    for path in sorted((REPO / package).rglob("*.py")):
        module = module_name(path)
        for imported in sorted(imported_modules(path, known) - {module}):
            if imported.split(".")[0] != package:
                wrong.append(f"{module} imports {imported}: the two halves never import each other")
            elif rank[imported] >= rank[module]:
                wrong.append(f"{module} imports {imported}, which is not on a lower line")
    assert not wrong, "\n".join(wrong)


def test_every_project_file_the_product_names_exists():
    """Prose that ages: a template, module or document the product's comments and docstrings name must be there
    (a module that moved left `gpuctl/protocol.py` in four templates)."""
    named = re.compile(r"(?<![\w$~./-])((?:gpuctl|training|templates|tests|bench|docs|scripts)/[\w/.-]*\.\w+)")
    stale = []
    for path in sorted([*(REPO / "templates").glob("*.j2"), *(REPO / "gpuctl").rglob("*.py"),
                        *(REPO / "training").rglob("*.py")]):
        for name in named.findall(path.read_text()):
            name = name.rstrip(".")
            if not re.search(r"[A-Z]{3,}", name) and not (REPO / name).exists():  # NAME.j2: a placeholder
                stale.append(f"{path.relative_to(REPO)}: {name}")
    assert not stale, stale


def test_the_product_cites_what_its_readers_have_not_issue_numbers():
    """A comment or docstring of the product cites docs/ARCHITECTURE.md, which users have, never the tracker."""
    cited = [f"{path.relative_to(REPO)}: {line.strip()[:80]}"
             for path in sorted([*(REPO / "templates").glob("*.j2"), *(REPO / "gpuctl").rglob("*.py"),
                                 *(REPO / "training").rglob("*.py")])
             for line in path.read_text().splitlines() if re.search(r"\bissues? \d+", line)]
    assert not cited, cited
