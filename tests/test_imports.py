"""The package's shape (docs/architecture.md): imports point down the layers and never form a cycle,
the kernel library stands alone, and no module grows past about 500 lines. Read from the source with
ast, so imports inside functions count too."""

import ast
from pathlib import Path

from tests.helpers import REPO

PACKAGE = REPO / "scalevec_train"
# Lower layers never import higher ones; modules of one group may import each other (without cycles),
# groups of the same layer may not.
LAYERS = {
    "scalevec_train.errors": 0,
    "scalevec_train.model": 1,
    "scalevec_train.data": 1,
    "scalevec_train.accounting": 2,
    "scalevec_train.activations": 2,
    "scalevec_train.optim": 2,
    "scalevec_train.parallel": 2,
    "scalevec_train.checkpoint": 3,
    "scalevec_train.training": 4,
    "scalevec_train.config": 5,
    "scalevec_train.interop": 6,
    "scalevec_train.describe": 7,
    "scalevec_train.memory": 6,
    "scalevec_train.branch": 6,
    "scalevec_train.build": 7,
    "scalevec_train.train": 8,
    "scalevec_train.prepare_data": 8,
    "scalevec_train.export": 8,
    "scalevec_train": 9,
}
MAX_LINES = 500


def module_name(path: Path, root: Path) -> str:
    parts = path.relative_to(root.parent).with_suffix("").parts
    return ".".join(parts[:-1] if parts[-1] == "__init__" else parts)


def imports(path: Path, root: Path) -> set[str]:
    """The modules of `root`'s package that the file imports (a `from package import name` counts as
    the submodule `package.name` when there is one). The package imports absolutely only."""
    found = set()
    for node in ast.walk(ast.parse(path.read_text())):
        if isinstance(node, ast.Import):
            found.update(a.name for a in node.names)
        elif isinstance(node, ast.ImportFrom):
            assert not node.level, f"{path}: relative import"
            for a in node.names:
                sub = root.parent / f"{node.module}.{a.name}".replace(".", "/")
                # `from package import submodule` depends on the submodule, not on the package's names
                is_module = sub.with_suffix(".py").exists() or sub.is_dir()
                found.add(f"{node.module}.{a.name}" if is_module else node.module)
    return {m for m in found if m == root.name or m.startswith(root.name + ".")}


def graph(root: Path) -> dict[str, set[str]]:
    return {module_name(p, root): imports(p, root) - {module_name(p, root)} for p in sorted(root.rglob("*.py"))}


def group(module: str) -> str:
    return max((g for g in LAYERS if module == g or module.startswith(g + ".")), key=len)


def test_every_module_has_a_layer():
    assert not [m for m in graph(PACKAGE) if m != "scalevec_train" and group(m) == "scalevec_train"]


def test_imports_point_down():
    upward = []
    for source, targets in graph(PACKAGE).items():
        for target in targets:
            s, t = group(source), group(target)
            if s != t and LAYERS[t] >= LAYERS[s]:
                upward.append(f"{source} -> {target}")
    assert not upward


def test_no_import_cycles():
    edges = graph(PACKAGE)
    done: set[str] = set()

    def visit(node: str, path: list[str]) -> None:
        if node in path:
            raise AssertionError("cycle: " + " -> ".join(path[path.index(node):] + [node]))
        if node in done:
            return
        for nxt in edges.get(node, ()):
            visit(nxt, path + [node])
        done.add(node)

    for node in edges:
        visit(node, [])


def test_model_code_never_imports_training_or_parallelism():
    for source, targets in graph(PACKAGE).items():
        if group(source) == "scalevec_train.model":
            assert {group(t) for t in targets} <= {"scalevec_train.model", "scalevec_train.errors"}, source


def test_the_kernel_library_stands_alone():
    root = REPO / "kernels" / "scalevec_kernels"
    for path in root.rglob("*.py"):
        assert "scalevec_train" not in path.read_text(), path


def test_no_module_is_long():
    long = {str(p.relative_to(REPO)): n for p in [*PACKAGE.rglob("*.py"), *(REPO / "scalevec_analysis").rglob("*.py")]
            if (n := len(p.read_text().splitlines())) > MAX_LINES}
    assert not long
