"""The structure the code promises, read from the source: compression never reaches back into the engine, only
paging/ changes block tables and KV lengths, and the top-level packages import in any order."""
from __future__ import annotations

import ast
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parent.parent
PACKAGES = ["paging", "compression", "engine", "api", "server"]
MUTATORS = {"append", "extend", "pop", "insert", "clear", "remove", "sort", "reverse", "__setitem__", "__delitem__"}
OWNED = {"block_table", "kv_len"}  # owned by paging/kv_cache_manager.py


def _modules(*dirs: str):
    for d in dirs:
        for path in sorted((ROOT / d).rglob("*.py")):
            yield path, ast.parse(path.read_text(), filename=str(path))


def _imports(tree: ast.AST) -> list[str]:
    names = []
    for node in ast.walk(tree):
        if isinstance(node, ast.Import):
            names += [a.name for a in node.names]
        elif isinstance(node, ast.ImportFrom) and node.level == 0 and node.module:
            names.append(node.module)
    return names


def _owned_attr(node: ast.AST) -> str | None:
    """`x.block_table` or `x.block_table[...]` (any depth of subscripts)."""
    while isinstance(node, ast.Subscript):
        node = node.value
    if isinstance(node, ast.Attribute) and node.attr in OWNED:
        return node.attr
    return None


def mutations_of_owned_state(tree: ast.AST) -> list[tuple[int, str]]:
    found = []
    for node in ast.walk(tree):
        targets = []
        if isinstance(node, ast.Assign):
            targets = node.targets
        elif isinstance(node, (ast.AugAssign, ast.AnnAssign)):
            targets = [node.target]
        elif isinstance(node, ast.Delete):
            targets = node.targets
        elif isinstance(node, ast.Call) and isinstance(node.func, ast.Attribute) and node.func.attr in MUTATORS:
            targets = [node.func.value]
        for t in targets:
            for sub in ast.walk(t) if isinstance(t, ast.Tuple) else [t]:
                attr = _owned_attr(sub)
                if attr:
                    found.append((node.lineno, attr))
    return sorted(found)


def test_compression_never_imports_the_engine():
    bad = [(p.relative_to(ROOT), name) for p, tree in _modules("compression") for name in _imports(tree)
           if name == "engine" or name.startswith("engine.")]
    assert not bad, f"compression/ imports the engine: {bad}"


def test_only_paging_changes_block_tables_and_kv_lengths():
    bad = [(str(p.relative_to(ROOT)), line, attr) for p, tree in _modules("engine", "compression", "server", "api",
                                                                          "bench")
           for line, attr in mutations_of_owned_state(tree)]
    assert not bad, f"block_table / kv_len changed outside paging/: {bad}"
    assert any(mutations_of_owned_state(tree) for _, tree in _modules("paging"))  # the check sees mutations


def test_the_mutation_finder_catches_every_form():
    src = """
s.block_table = []
s.block_table += [1]
s.block_table.append(3)
s.block_table.extend([4])
del s.block_table[2:]
s.block_table[0] = 5
s.kv_len = 3
s.kv_len += 1
a, s.kv_len = 1, 2
x = s.block_table[0]
y = len(s.block_table)
"""
    assert [line for line, _ in mutations_of_owned_state(ast.parse(src))] == [2, 3, 4, 5, 6, 7, 8, 9, 10]


@pytest.mark.parametrize("first", PACKAGES)
def test_packages_import_in_any_order(first):
    order = [first] + [p for p in reversed(PACKAGES) if p != first]
    code = "; ".join(f"import {p}" for p in order) + "; import engine.engine, server.app, compression.stage"
    r = subprocess.run([sys.executable, "-c", code], cwd=ROOT, capture_output=True, text=True, timeout=120)
    assert r.returncode == 0, r.stderr[-2000:]


def test_no_merge_conflict_remnants_and_docs_code_fences_are_balanced():
    """A half-resolved merge once left a bare '=======' and a split code block in docs/benchmarks.md."""
    tracked = subprocess.run(["git", "ls-files"], cwd=ROOT, capture_output=True, text=True).stdout.split()
    if not tracked:
        pytest.skip("not a git checkout")
    bad = []
    for name in tracked:
        if not name.endswith((".py", ".md", ".cpp", ".toml", ".txt", ".sh", ".cfg")) and name != "Makefile":
            continue
        for i, line in enumerate((ROOT / name).read_text(errors="ignore").splitlines(), 1):
            if line == "=======" or line.startswith(("<<<<<<< ", ">>>>>>> ")):
                bad.append(f"{name}:{i}")
    assert not bad, f"merge-conflict markers at {bad}"
    for doc in (ROOT / "docs").glob("*.md"):
        fences = sum(1 for line in doc.read_text().splitlines() if line.startswith("```"))
        assert fences % 2 == 0, f"{doc.name}: an unclosed code block"


# -- the re-seated engine step (one owner per concern, plain results between them) ----------------------------
def test_paging_imports_neither_the_engine_nor_compression():
    bad = [(str(p.relative_to(ROOT)), name) for p, tree in _modules("paging") for name in _imports(tree)
           if name.split(".")[0] in ("engine", "compression", "server", "api")]
    assert not bad, f"paging/ imports: {bad}"


def _count_statements(fn: ast.FunctionDef) -> int:
    return sum(1 for node in ast.walk(fn) if isinstance(node, ast.stmt) and node is not fn)


def test_the_engine_step_is_a_short_loop_over_its_owners():
    tree = ast.parse((ROOT / "engine" / "core.py").read_text())
    cls = next(n for n in tree.body if isinstance(n, ast.ClassDef) and n.name == "EngineCore")
    step = next(n for n in cls.body if isinstance(n, ast.FunctionDef) and n.name == "step")
    assert _count_statements(step) <= 15, f"EngineCore.step has {_count_statements(step)} statements"


def test_statement_counter_counts_nested_statements():
    fn = ast.parse("def f():\n    a = 1\n    if a:\n        b = 2\n        c = 3\n    return a\n").body[0]
    assert _count_statements(fn) == 5


def _compression_state_methods() -> set[str]:
    import inspect

    from compression.state import CompressionState

    return {name for name, member in inspect.getmembers(CompressionState, inspect.isfunction)
            if not name.startswith("_")}


def compression_state_reads(tree: ast.AST, methods: set[str]) -> list[tuple[int, str]]:
    """`<x>.compression.<name>` that is not a call of a CompressionState method, and aliases `y = <x>.compression`
    (which would hide later reads)."""
    calls = {id(n.func) for n in ast.walk(tree) if isinstance(n, ast.Call)}
    bad = []
    for node in ast.walk(tree):
        if (isinstance(node, ast.Attribute) and isinstance(node.value, ast.Attribute)
                and node.value.attr == "compression" and not (id(node) in calls and node.attr in methods)):
            bad.append((node.lineno, node.attr))
        if (isinstance(node, ast.Assign) and isinstance(node.value, ast.Attribute)
                and node.value.attr == "compression"):
            bad.append((node.lineno, "alias"))
    return sorted(bad)


def test_only_compression_reads_compression_state_and_names_methods():
    from compression import registry

    methods = _compression_state_methods()
    outside = ("engine", "paging", "server", "api", "util")
    reads = [(str(p.relative_to(ROOT)), line, what) for p, tree in _modules(*outside)
             for line, what in compression_state_reads(tree, methods)]
    assert not reads, f"compression state read outside compression/: {reads}"
    names = set(registry.names()) - {"none"}
    named = [(str(p.relative_to(ROOT)), node.lineno, node.value) for p, tree in _modules(*outside)
             for node in ast.walk(tree) if isinstance(node, ast.Constant) and node.value in names]
    assert not named, f"compression methods named outside compression/: {named}"


def test_the_compression_state_read_finder_catches_reads_and_aliases():
    src = "seq.compression.config.lossless\nst = seq.compression\nseq.compression.on_preempt()\nseq.compression.x()\n"
    assert compression_state_reads(ast.parse(src), {"on_preempt"}) == [(1, "config"), (2, "alias"), (4, "x")]


def test_every_engine_setting_has_a_generated_flag():
    from dataclasses import fields

    from engine.config import EngineConfig
    from server.cli import build_parser

    serve = next(a for a in build_parser()._subparsers._group_actions[0].choices.values()
                 if any(getattr(x, "dest", None) == "tokenizer" for x in a._actions))
    dests = {a.dest for a in serve._actions}
    missing = [f.name for f in fields(EngineConfig) if f.name != "model" and f.name not in dests]
    assert not missing, f"EngineConfig fields without a flag: {missing}"
    assert all("setting" in f.metadata for f in fields(EngineConfig)), "a field without its setting() declaration"
    # no hand list of them in the CLI: it reads the declarations (engine/argspec.py)
    cli = ast.parse((ROOT / "server" / "cli.py").read_text())
    flags = {f.name for f in fields(EngineConfig) if f.metadata["setting"]["flag"]}  # (MODEL is positional)
    listed = {n.value for n in ast.walk(cli) if isinstance(n, ast.Constant)} & flags
    assert not listed, f"server/cli.py names EngineConfig fields by hand: {listed}"


def test_every_engine_statistic_is_exported():
    import types
    from dataclasses import fields

    from compression.stats import RoundStats, counted_fields
    from engine.outputs import EngineStats
    from server.metrics import ServerMetrics

    stats = EngineStats()
    stats.compression.method("kara").rounds = 1
    engine = types.SimpleNamespace(stats=lambda: stats, is_healthy=lambda: True, config=None,
                                   kv_compression_config=None, model_name="m")
    text = ServerMetrics(engine, "m", ("kvllm:",)).render().decode()
    for f in fields(EngineStats):
        if f.name == "compression":
            for g in counted_fields():
                assert f"kvllm:compression_{g.name}" in text and f"kvllm:compression_method_{g.name}" in text, g.name
            continue
        name = f.metadata["metric"] or f.name
        assert f"\nkvllm:{name}" in text, f"EngineStats.{f.name} is not exported"
    assert isinstance(stats.compression, RoundStats)


def test_no_module_grows_past_a_readable_size():
    """A file past ~450 lines usually mixes concerns (split the bench scripts: runs, cases, report). The few
    single-concern files above it are named here with the reason."""
    single_concern = {"compression/ams.py": "one method: its scorer, its drift detector, its settings"}
    limit = 460
    long = {str(p.relative_to(ROOT)): n for d in [*PACKAGES, "bench", "util"] if (ROOT / d).exists()
            for p in sorted((ROOT / d).rglob("*.py")) if (n := len(p.read_text().splitlines())) > limit}
    assert set(long) <= set(single_concern), long


# -- imports: no cycles between project modules, project imports at module level, no method patching -------------
PRODUCT = ["api", "server", "engine", "paging", "compression", "util"]
PROJECT = {*PRODUCT, "bench"}  # bench/ checks its own cycles; here it only counts as an imported project package

#: (file, imported project module) -> why the import stays inside a function. Only an import that must not run at
#: module import time belongs here.
LOCAL_IMPORTS_ALLOWED = {
    ("engine/__init__.py", "engine.engine"):
        "`import engine` stays free of torch, so configure_threads() can run first (engine/threads.py)",
    ("engine/outputs.py", "compression.stats"):
        "`import engine` stays free of torch (engine/threads.py); compression/__init__ imports torch",
    ("engine/sampling_params.py", "compression.config"):
        "`import engine` stays free of torch (engine/threads.py); compression/__init__ imports torch",
    ("server/cli.py", "engine.config"): "main() runs configure_threads() before torch is imported (engine/threads.py)",
    ("server/cli.py", "server.config"): "main() runs configure_threads() before torch is imported (engine/threads.py)",
    ("server/cli.py", "engine.engine"): "main() runs configure_threads() before torch is imported (engine/threads.py)",
    ("server/cli.py", "engine.process"): "main() runs configure_threads() before torch is imported (engine/threads.py)",
    ("server/cli.py", "server.app"): "main() runs configure_threads() before torch is imported (engine/threads.py)",
}


def _module_name(path: Path) -> str:
    parts = path.relative_to(ROOT).with_suffix("").parts
    return ".".join(parts[:-1] if parts[-1] == "__init__" else parts)


def _project_files(packages) -> dict[str, Path]:
    return {_module_name(p): p for d in packages for p in sorted((ROOT / d).rglob("*.py"))}


def _is_type_checking(node: ast.If) -> bool:
    t = node.test
    return isinstance(t, ast.Name) and t.id == "TYPE_CHECKING" or isinstance(t, ast.Attribute) and \
        t.attr == "TYPE_CHECKING"


def import_statements(tree: ast.AST) -> list[tuple[ast.Import | ast.ImportFrom, bool]]:
    """Every import statement with whether it runs inside a function; those under `if TYPE_CHECKING:` never run
    and are left out."""
    found = []

    def visit(node: ast.AST, local: bool) -> None:
        for child in ast.iter_child_nodes(node):
            if isinstance(child, ast.If) and _is_type_checking(child):
                for stmt in child.orelse:
                    visit(ast.Module(body=[stmt], type_ignores=[]), local)
                continue
            if isinstance(child, (ast.Import, ast.ImportFrom)):
                found.append((child, local))
            visit(child, local or isinstance(child, (ast.FunctionDef, ast.AsyncFunctionDef, ast.Lambda)))

    visit(tree, False)
    return found


def imported_modules(module: str, is_package: bool, node: ast.Import | ast.ImportFrom, known) -> list[str]:
    """The project modules an import statement names: `from a.b import c` is a.b.c where that is a module, else
    a.b; relative imports are resolved against `module`."""
    if isinstance(node, ast.Import):
        names = [a.name for a in node.names]
    else:
        base = node.module or ""
        if node.level:
            parts = module.split(".")[: len(module.split(".")) - (node.level - is_package)]
            base = ".".join(parts + ([node.module] if node.module else []))
        names = [f"{base}.{a.name}" if f"{base}.{a.name}" in known else base for a in node.names]
    out = []
    for name in names:
        while name not in known and "." in name:
            name = name.rsplit(".", 1)[0]
        if name in known:
            out.append(name)
    return out


def import_graph(packages=PRODUCT):
    """module -> project modules it imports (module level or in a function), and the function-local imports as
    (file, line, imported module)."""
    known = _project_files(PROJECT)
    edges: dict[str, set[str]] = {}
    local = []
    for name, path in _project_files(packages).items():
        for node, is_local in import_statements(ast.parse(path.read_text(), filename=str(path))):
            for target in imported_modules(name, path.name == "__init__.py", node, known):
                edges.setdefault(name, set()).add(target)
                if is_local:
                    local.append((str(path.relative_to(ROOT)), node.lineno, target))
    return edges, sorted(set(local))


def cycles(edges: dict[str, set[str]]) -> list[list[str]]:
    """The strongly connected components of more than one module (Tarjan), and modules importing themselves."""
    index: dict[str, int] = {}
    low: dict[str, int] = {}
    stack: list[str] = []
    found = []

    def connect(v: str) -> None:
        index[v] = low[v] = len(index)
        stack.append(v)
        for w in sorted(edges.get(v, ())):
            if w not in index:
                connect(w)
                low[v] = min(low[v], low[w])
            elif w in stack:
                low[v] = min(low[v], index[w])
        if low[v] == index[v]:
            comp = []
            while not comp or comp[-1] != v:
                comp.append(stack.pop())
            if len(comp) > 1 or v in edges.get(v, ()):
                found.append(sorted(comp))

    for v in sorted(edges):
        if v not in index:
            connect(v)
    return sorted(found)


def test_no_import_cycle_between_project_modules():
    edges, _ = import_graph()
    product = {m: {t for t in ts if t.split(".")[0] in PRODUCT} for m, ts in edges.items()}
    found = cycles(product)
    assert not found, "import cycles: " + "; ".join(
        " <-> ".join(c) + " (" + ", ".join(f"{a} -> {b}" for a in c for b in sorted(product[a]) if b in c) + ")"
        for c in found)


def test_the_import_graph_sees_local_relative_and_package_imports_but_not_type_checking_ones():
    src = """
from typing import TYPE_CHECKING
from engine.attention import cpu_ext, get_backend
import paging.kv_cache
if TYPE_CHECKING:
    from engine.sequence import Sequence
def f():
    from .base import AttentionMetadata
"""
    known = {"engine", "engine.attention", "engine.attention.cpu_ext", "engine.attention.base", "paging.kv_cache",
             "engine.sequence"}
    found = [(m, local) for node, local in import_statements(ast.parse(src))
             for m in imported_modules("engine.attention.cpu_paged", False, node, known)]
    assert found == [("engine.attention.cpu_ext", False), ("engine.attention", False), ("paging.kv_cache", False),
                     ("engine.attention.base", True)]
    assert cycles({"a": {"b"}, "b": {"c"}, "c": {"a"}, "d": {"a"}}) == [["a", "b", "c"]]


def test_project_modules_are_imported_at_module_level():
    _, local = import_graph()
    bad = [f"{path}:{line} imports {target}" for path, line, target in local
           if (path, target) not in LOCAL_IMPORTS_ALLOWED]
    assert not bad, "function-local imports of project modules (move them to the top, or break the cycle they " \
                    "hide): " + ", ".join(bad)
    used = {(path, target) for path, _, target in local}
    assert set(LOCAL_IMPORTS_ALLOWED) <= used, f"stale entries: {set(LOCAL_IMPORTS_ALLOWED) - used}"


def test_the_torch_free_imports_stay_torch_free():
    """What LOCAL_IMPORTS_ALLOWED protects: the CLI and the engine package import without torch."""
    code = "import sys, engine, server.cli; assert 'torch' not in sys.modules, 'torch imported'"
    r = subprocess.run([sys.executable, "-c", code], cwd=ROOT, capture_output=True, text=True, timeout=120)
    assert r.returncode == 0, r.stderr[-2000:]


def test_no_method_patching():
    """A backend that changes a model's behaviour gives it a layer object; it does not rebind its methods."""
    bad = [f"{p.relative_to(ROOT)}:{node.lineno}" for p, tree in _modules(*PRODUCT) for node in ast.walk(tree)
           if isinstance(node, ast.Name) and node.id == "MethodType"
           or isinstance(node, ast.Attribute) and node.attr == "MethodType"
           or isinstance(node, ast.alias) and node.name == "MethodType"]
    assert not bad, f"types.MethodType at {bad}"
