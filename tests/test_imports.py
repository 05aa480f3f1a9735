"""The package's import graph (read from the source with ``ast``, imports inside functions included):
no cycles, the model and data packages depend only on lower modules, and training not on infer/."""

import ast
from pathlib import Path

import hydra_lm

PACKAGE = Path(hydra_lm.__file__).parent
# What each low-level package may import from hydra_lm besides itself.
ALLOWED = {
    "hydra_lm.kernels": (),
    "hydra_lm.model": ("hydra_lm.config", "hydra_lm.version", "hydra_lm.kernels", "hydra_lm.kernels.ccgqa_decode",
                       "hydra_lm.kernels.route_decode", "hydra_lm.kernels.cross_entropy_rows",
                       "hydra_lm.kernels.sorted_index_add"),
    "hydra_lm.data": ("hydra_lm.version",),
}


def module_files() -> dict[str, tuple[Path, bool]]:
    mods = {}
    for path in PACKAGE.rglob("*.py"):
        parts = list(path.relative_to(PACKAGE.parent).with_suffix("").parts)
        is_pkg = parts[-1] == "__init__"
        mods[".".join(parts[:-1] if is_pkg else parts)] = (path, is_pkg)
    return mods


def import_graph() -> dict[str, set[str]]:
    """module -> the hydra_lm modules it imports (``from pkg import sub`` counts as importing ``pkg.sub``)."""
    mods = module_files()
    graph: dict[str, set[str]] = {}
    for name, (path, is_pkg) in mods.items():
        targets: set[str] = set()
        for node in ast.walk(ast.parse(path.read_text(encoding="utf-8"))):
            if isinstance(node, ast.Import):
                targets.update(a.name for a in node.names)
            elif isinstance(node, ast.ImportFrom):
                if node.level:
                    base = name.split(".") if is_pkg else name.split(".")[:-1]
                    base = base[:len(base) - node.level + 1]
                    module = ".".join(base + ([node.module] if node.module else []))
                else:
                    module = node.module or ""
                targets.update(f"{module}.{a.name}" if f"{module}.{a.name}" in mods else module for a in node.names)
        graph[name] = {t for t in targets if t in mods and t != name}
    return graph


def find_cycle(graph: dict[str, set[str]]) -> list[str] | None:
    state: dict[str, int] = {}  # 1: on the current path, 2: done
    path: list[str] = []

    def visit(node: str) -> list[str] | None:
        state[node] = 1
        path.append(node)
        for nxt in sorted(graph[node]):
            if state.get(nxt) == 1:
                return path[path.index(nxt):] + [nxt]
            if nxt not in state and (cycle := visit(nxt)):
                return cycle
        state[node] = 2
        path.pop()
        return None

    for node in sorted(graph):
        if node not in state and (cycle := visit(node)):
            return cycle
    return None


def test_the_checker_sees_imports_and_cycles():
    graph = import_graph()
    assert "hydra_lm.model.hydra" in graph["hydra_lm.model.factory"]
    assert "hydra_lm.model.factory" in graph["hydra_lm"]
    assert "hydra_lm.model.factory" in graph["hydra_lm.train.trainer"]
    assert find_cycle({"a": {"b"}, "b": {"c"}, "c": {"a"}, "d": {"a"}}) == ["a", "b", "c", "a"]
    assert find_cycle({"a": {"b"}, "b": set()}) is None


def test_import_graph_has_no_cycles():
    assert find_cycle(import_graph()) is None


def test_training_knows_nothing_of_using_runs():
    """train/ is for training: infer/ (using finished runs), diagnostics and the CLI build on it, never the reverse."""
    graph = import_graph()
    above = ("hydra_lm.infer", "hydra_lm.diagnostics", "hydra_lm.cli", "hydra_lm.quickstart")
    wrong = [(m, t) for m, targets in graph.items() if m.startswith("hydra_lm.train") for t in targets
             if t.startswith(above)]
    assert not wrong, wrong
    assert "hydra_lm.train.checkpoint" in graph["hydra_lm.infer.runs"]  # the checker sees infer's imports


def test_packages_import_downward_only():
    graph = import_graph()
    wrong = []
    for module, targets in graph.items():
        if module == "hydra_lm":
            continue
        if "hydra_lm" in targets:  # a submodule reaching back into the package root
            wrong.append((module, "hydra_lm"))
        for package, allowed in ALLOWED.items():
            if module == package or module.startswith(package + "."):
                wrong += [(module, t) for t in targets
                          if t != "hydra_lm" and not t.startswith(package + ".") and t != package and t not in allowed]
    assert not wrong, wrong
