"""bench/ and tests/ reach bench modules only through their public names: no `from bench.x import _name`, no
`import bench.x as m` followed by `m._name`, no `bench.x._name`. A helper another file needs is part of its module's
public API (renamed without the underscore, or moved to bench.common); private names stay free to change."""
from __future__ import annotations

import ast
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent


def _is_bench(module: str | None) -> bool:
    return module is not None and (module == "bench" or module.startswith("bench."))


def _private(name: str) -> bool:
    return name.startswith("_") and not (name.startswith("__") and name.endswith("__"))


def _dotted(node: ast.AST) -> str | None:
    """'a.b.c' for a chain of Name/Attribute nodes, else None."""
    parts = []
    while isinstance(node, ast.Attribute):
        parts.append(node.attr)
        node = node.value
    if not isinstance(node, ast.Name):
        return None
    parts.append(node.id)
    return ".".join(reversed(parts))


def private_bench_uses(source: str, path: str = "<src>") -> list[str]:
    """Every private bench name `source` reaches: imported from a bench module, or read as an attribute of a name
    bound to a bench module (`import bench.x`, `import bench.x as m`, `from bench import x`)."""
    tree = ast.parse(source, path)
    aliases: set[str] = set()  # dotted names bound to bench modules in this file
    found = []
    for node in ast.walk(tree):
        relative_in_bench = node.level > 0 if isinstance(node, ast.ImportFrom) else False
        relative_in_bench = relative_in_bench and Path(path).parts[:1] == ("bench",)
        if isinstance(node, ast.ImportFrom) and (relative_in_bench or node.level == 0 and _is_bench(node.module)):
            for a in node.names:
                if _private(a.name):
                    found.append(f"{path}:{node.lineno}: from {node.module} import {a.name}")
                elif node.module == "bench" and node.level == 0:  # `from bench import soak`: soak is a module
                    aliases.add(a.asname or a.name)
        elif isinstance(node, ast.Import):
            for a in node.names:
                if _is_bench(a.name):
                    if any(_private(p) for p in a.name.split(".")):
                        found.append(f"{path}:{node.lineno}: import {a.name}")
                    if a.asname:
                        aliases.add(a.asname)
                    else:  # `import bench.x.y` binds bench, reachable as bench.x.y
                        parts = a.name.split(".")
                        aliases.update(".".join(parts[:i]) for i in range(1, len(parts) + 1))
    for node in ast.walk(tree):
        if isinstance(node, ast.Attribute) and _private(node.attr):
            owner = _dotted(node.value)
            if owner is not None and owner in aliases:
                found.append(f"{path}:{node.lineno}: {owner}.{node.attr}")
    return found


def _sources():
    for folder in ("bench", "tests"):
        for path in sorted((ROOT / folder).rglob("*.py")):
            yield path


def test_no_private_bench_names():
    found = []
    for path in _sources():
        found += private_bench_uses(path.read_text(), str(path.relative_to(ROOT)))
    assert not found, "private bench names used outside their module:\n" + "\n".join(found)


def test_detector_sees_each_form():
    src = ("from bench.compression_quality import evaluate, _passage_stats\n"
           "import bench.soak as soak\n"
           "import bench.pareto\n"
           "from bench import common\n"
           "soak._free(); bench.pareto._units(); common._x; soak.run(); other._y\n")
    found = private_bench_uses(src)
    assert sorted(f.split(": ", 1)[1] for f in found) == [
        "bench.pareto._units", "common._x", "from bench.compression_quality import _passage_stats", "soak._free"]
    assert len(private_bench_uses("from .client import _run\n", "bench/serve_client/cli.py")) == 1
    assert private_bench_uses("from bench.common import write_section\nfrom x import _y\nimport os\nos._exit\n") == []


def _module_name(path: Path) -> str:
    parts = list(path.relative_to(ROOT).with_suffix("").parts)
    return ".".join(parts[:-1] if parts[-1] == "__init__" else parts)


def bench_import_graph() -> dict[str, set[str]]:
    """bench module -> the bench modules it imports anywhere in its file (function-local imports included: a
    cycle hidden in a function is still a cycle)."""
    modules = {_module_name(p): p for p in (ROOT / "bench").rglob("*.py")}
    graph: dict[str, set[str]] = {}
    for name, path in modules.items():
        deps = set()
        for node in ast.walk(ast.parse(path.read_text(), str(path))):
            targets = []
            if isinstance(node, ast.Import):
                targets = [a.name for a in node.names]
            elif isinstance(node, ast.ImportFrom) and node.level == 0 and node.module:
                targets = [node.module] + [f"{node.module}.{a.name}" for a in node.names]
            deps.update(t for t in targets if t in modules and t != name and not name.startswith(t + "."))
        graph[name] = deps
    return graph


def test_no_import_cycle_in_bench():
    graph = bench_import_graph()
    cycles = []
    state: dict[str, int] = {}  # 1: on the stack, 2: done

    def visit(node: str, stack: list[str]) -> None:
        state[node] = 1
        for dep in sorted(graph[node]):
            if state.get(dep) == 1:
                cycles.append(" -> ".join(stack[stack.index(dep):] + [node, dep]) if dep in stack
                              else f"{node} -> {dep}")
            elif dep not in state:
                visit(dep, stack + [node])
        state[node] = 2

    for node in sorted(graph):
        if node not in state:
            visit(node, [])
    assert not cycles, "import cycles among bench modules:\n" + "\n".join(cycles)
