"""The package's shape (docs/concepts/architecture.md): imports point down the layers and never form
a cycle, the kernel library and the analysis package stand beside it, and no module grows past about
500 lines. Read from the source with ast, so imports inside functions count too."""

import ast
import re
from pathlib import Path

from tests.support.helpers import REPO

PACKAGE = REPO / "scalevec_train"
ANALYSIS = REPO / "scalevec_analysis"
KERNELS = REPO / "kernels" / "scalevec_kernels"
MAX_LINES = 500


def documented_layers() -> dict[str, int]:
    """docs/concepts/architecture.md's layer table, {module or package: layer}: lower layers never
    import higher ones; modules of one group may import each other (without cycles), groups of the
    same layer may not. The package's own __init__ sits above them all."""
    layers = {}
    table = (REPO / "docs" / "concepts" / "architecture.md").read_text()
    for layer, names in re.findall(r"^\| (\d+) \| (.+?) \|", table, re.M):
        for name in re.findall(r"`([\w/.]+)`", names):
            layers["scalevec_train."
                   + name.removesuffix("/").removesuffix(".py").replace("/", ".")] = int(layer)
    layers["scalevec_train"] = max(layers.values()) + 1
    return layers


LAYERS = documented_layers()


def test_the_layer_table_names_real_modules():
    assert len(LAYERS) > 10
    for name in LAYERS:
        path = REPO / name.replace(".", "/")
        assert path.is_dir() or path.with_suffix(".py").is_file(), name


def module_name(path: Path, root: Path) -> str:
    parts = path.relative_to(root.parent).with_suffix("").parts
    return ".".join(parts[:-1] if parts[-1] == "__init__" else parts)


def all_imports(path: Path, root: Path) -> set[str]:
    """Every module the file imports, absolute or relative (a `from package import name` counts as
    the submodule `package.name` when `root`'s package has one)."""
    found = set()
    for node in ast.walk(ast.parse(path.read_text())):
        if isinstance(node, ast.Import):
            found.update(a.name for a in node.names)
        elif isinstance(node, ast.ImportFrom):
            module = node.module or ""
            if node.level:
                package = module_name(path, root).split(".")
                package = package[:len(package) - node.level + (path.name == "__init__.py")]
                module = ".".join(package + ([module] if module else []))
            for a in node.names:
                sub = root.parent / f"{module}.{a.name}".replace(".", "/")
                # `from package import submodule` depends on the submodule, not on the package's
                # names
                is_module = sub.with_suffix(".py").exists() or sub.is_dir()
                found.add(f"{module}.{a.name}" if is_module else module)
    return found


def imports(path: Path, root: Path) -> set[str]:
    """The modules of `root`'s package that the file imports. The package imports absolutely
    only."""
    assert not any(isinstance(n, ast.ImportFrom) and n.level
                   for n in ast.walk(ast.parse(path.read_text()))), \
        f"{path}: relative import"
    return {m for m in all_imports(path, root) if m == root.name or m.startswith(root.name + ".")}


def test_imports_are_parsed_whole():
    """The parser itself: absolute and relative imports, inside functions too, `from package import
    submodule` as the submodule."""
    found = all_imports(KERNELS / "__init__.py", KERNELS)
    assert {"scalevec_kernels.backend", "scalevec_kernels.rms_norm"} <= found
    assert "torch" in all_imports(KERNELS / "rms_norm.py", KERNELS)
    assert "scalevec_train.model.moe" in imports(PACKAGE / "costs" / "accounting.py", PACKAGE)
    # imported inside a function
    assert "scalevec_train.config" in imports(ANALYSIS / "runs.py", PACKAGE)


def graph(root: Path) -> dict[str, set[str]]:
    return {module_name(p, root): imports(p, root) - {module_name(p, root)}
            for p in sorted(root.rglob("*.py"))}


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
            assert {t if group(t) == "scalevec_train.infra" else group(t) for t in targets} <= {
                "scalevec_train.model", "scalevec_train.infra.errors"}, source


def test_the_kernel_library_stands_alone():
    """It imports torch, triton, the standard library and itself: neither the framework nor the
    analysis."""
    for path in KERNELS.rglob("*.py"):
        tops = {m.split(".")[0] for m in all_imports(path, KERNELS)}
        assert not tops & {"scalevec_train", "scalevec_analysis"}, path


def test_the_analysis_stands_beside_the_package():
    """scalevec_train never imports scalevec_analysis (matplotlib stays an optional extra); the
    analysis imports the framework's errors, the metrics.jsonl reader (training.logger), the
    resumes.jsonl reader (run.resume) and, lazily, its config, nothing that trains."""
    for path in PACKAGE.rglob("*.py"):
        assert not any(m.split(".")[0] == "scalevec_analysis"
                       for m in all_imports(path, PACKAGE)), path
    used = set()
    for path in ANALYSIS.rglob("*.py"):
        used |= imports(path, PACKAGE)
    assert used <= {"scalevec_train.infra.errors", "scalevec_train.config",
                    "scalevec_train.training.logger", "scalevec_train.run.resume"}, used


def test_no_module_is_long():
    long = {str(p.relative_to(REPO)): n for p in [*PACKAGE.rglob("*.py"), *ANALYSIS.rglob("*.py")]
            if (n := len(p.read_text().splitlines())) > MAX_LINES}
    assert not long
