"""How far a reader travels following the trainer's config from `build_world` (issue 40): a static walk.

    python bench/config_walk.py [TREE ...]    (default: this checkout; another checkout's root to compare)

From training/trainer/world.py's `build_world`, every call that passes the config on (positionally or by
keyword, under whatever name the callee gives it) is followed into the callee, depth first, each function once:
a function, a class's `__init__`, a method of the same class through `self.`. A callee given only a field of the
config (`config.compile`) is read too, but not followed on. The reader's trail is the module of
each function entered and, after it, of the caller returned to. Printed per tree, by module and by folder (the
package under training/ a module is in: what a reader opens): the functions read (stays), the changes on the
trail, the returns (a change back into a home the trail had left before) and the homes returned to most. Calls through objects other than `self` (a replica's method) are not followed: what a
reader can follow by name alone.
"""

from __future__ import annotations

import argparse
import ast
import collections
from pathlib import Path

START = ("training.trainer.world", "build_world")


class Tree:
    """The modules of a checkout's training/ package: their functions, classes and imported names."""

    def __init__(self, root: Path):
        self.functions: dict[tuple[str, str], ast.FunctionDef] = {}
        self.imports: dict[str, dict[str, tuple[str, str | None]]] = {}
        for path in sorted((root / "training").rglob("*.py")):
            parts = list(path.relative_to(root).with_suffix("").parts)
            if parts[-1] == "__init__":
                parts.pop()
            module = ".".join(parts)
            tree = ast.parse(path.read_text())
            self.imports[module] = names = {}
            for node in ast.walk(tree):
                if isinstance(node, ast.ImportFrom) and node.module and node.level == 0:
                    for alias in node.names:
                        names[alias.asname or alias.name] = (node.module, alias.name)
                elif isinstance(node, ast.Import):
                    for alias in node.names:
                        names[alias.asname or alias.name.split(".")[0]] = (alias.name, None)
            for node in tree.body:
                if isinstance(node, ast.FunctionDef):
                    self.functions[module, node.name] = node
                elif isinstance(node, ast.ClassDef):
                    for item in node.body:
                        if isinstance(item, ast.FunctionDef):
                            self.functions[module, f"{node.name}.{item.name}"] = item

    def resolve(self, module: str, name: str, depth: int = 0) -> tuple[str, str] | None:
        """Where `name` as seen in `module` is defined: a function, or a class (its __init__)."""
        for key in ((module, name), (module, f"{name}.__init__")):
            if key in self.functions:
                return key
        source = self.imports.get(module, {}).get(name)
        if source and source[1] and depth < 8 and source[0].startswith("training"):
            return self.resolve(source[0], source[1], depth + 1)
        return None


def callee_of(tree: Tree, module: str, owner: str | None, call: ast.Call) -> tuple[str, str] | None:
    func = call.func
    if isinstance(func, ast.Name):
        return tree.resolve(module, func.id)
    if isinstance(func, ast.Attribute) and isinstance(func.value, ast.Name):
        if func.value.id == "self" and owner:
            return tree.resolve(module, f"{owner}.{func.attr}")
        source = tree.imports.get(module, {}).get(func.value.id)
        if source and source[1] is None:  # module.function
            return tree.resolve(source[0], func.attr)
        if source:  # a package's submodule imported by name: from training import config
            return tree.resolve(f"{source[0]}.{source[1]}", func.attr)
    return None


def rooted_in(node: ast.expr, name: str) -> bool:
    """`name` itself or one of its fields (name.a.b)."""
    while isinstance(node, ast.Attribute):
        node = node.value
    return isinstance(node, ast.Name) and node.id == name


def received_as(function: ast.FunctionDef, call: ast.Call, name: str, method: bool) -> str | None:
    """The callee's parameter that gets `name` in `call` (the config itself: followed on from there); "" where
    the callee gets only a field of it (read, not followed further); None where it gets neither."""
    params = [a.arg for a in function.args.posonlyargs + function.args.args]
    if method:
        params = params[1:]
    got = [(params[i] if i < len(params) else "", arg) for i, arg in enumerate(call.args)]
    got += [(k.arg or "", k.value) for k in call.keywords]
    whole = [param for param, arg in got if isinstance(arg, ast.Name) and arg.id == name and param]
    if whole:
        return whole[0]
    return "" if any(rooted_in(arg, name) for _, arg in got) else None


def walk(tree: Tree) -> tuple[list[tuple[str, str]], list[str]]:
    """The functions read, in order, and the trail of modules (consecutive repeats collapsed)."""
    read: list[tuple[str, str]] = []
    trail: list[str] = []

    def step(module: str) -> None:
        if not trail or trail[-1] != module:
            trail.append(module)

    def visit(key: tuple[str, str], name: str) -> None:
        read.append(key)
        module, qualname = key
        step(module)
        if not name:  # a field of the config: read here, not followed on
            return
        owner = qualname.split(".")[0] if "." in qualname else None
        for call in (n for n in ast.walk(tree.functions[key]) if isinstance(n, ast.Call)):
            callee = callee_of(tree, module, owner, call)
            if callee is None or callee in read:
                continue
            function = tree.functions[callee]
            parameter = received_as(function, call, name, method="." in callee[1])
            if parameter is not None:
                visit(callee, parameter)
                step(module)

    visit(START, "config")
    return read, trail


def package(module: str) -> str:
    """A module's folder under training/ (training.data.chat: training.data); a top-level module is its own."""
    return ".".join(module.split(".")[:2])


def counted(trail: list[str]) -> tuple[int, int, int, str]:
    """Homes, changes, returns and the two homes returned to most, of a trail (repeats collapsed again)."""
    trail = [home for i, home in enumerate(trail) if i == 0 or trail[i - 1] != home]
    seen: set[str] = set()
    returns: collections.Counter[str] = collections.Counter()
    for home in trail:
        if home in seen:
            returns[home] += 1
        seen.add(home)
    top = ", ".join(f"{m.removeprefix('training.')} {n}" for m, n in returns.most_common(2))
    return len(seen), len(trail) - 1, sum(returns.values()), top


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("trees", nargs="*", type=Path, default=[Path(__file__).resolve().parents[1]])
    args = parser.parse_args()
    print("| tree | functions read | homes: | how many | changes | returns | most returned to |")
    print("|---|---:|---|---:|---:|---:|---|")
    for root in args.trees:
        read, trail = walk(Tree(root))
        for level, homes in (("modules", trail), ("folders", [package(m) for m in trail])):
            print(f"| {root} | {len(read)} | {level} | " + " | ".join(map(str, counted(homes))) + " |")


if __name__ == "__main__":
    main()
