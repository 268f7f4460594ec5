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
