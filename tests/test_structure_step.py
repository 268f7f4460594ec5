"""The shape of one engine step, read from the code (ast), so it stays the way docs/DESIGN.md draws it: the step
is schedule -> execute -> update plus a loop over its step components; owners are wired through their constructors,
never by assigning a callable to another owner's attribute; the scheduler decides and allocates, and imports
neither the model runner nor the compression stage."""
from __future__ import annotations

import ast
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
PRODUCT = ("api", "server", "engine", "paging", "compression", "util")


def _tree(rel: str) -> ast.Module:
    return ast.parse((ROOT / rel).read_text(), rel)


def _function(tree: ast.Module, cls: str, name: str) -> ast.FunctionDef:
    for node in ast.walk(tree):
        if isinstance(node, ast.ClassDef) and node.name == cls:
            for item in node.body:
                if isinstance(item, ast.FunctionDef) and item.name == name:
                    return item
    raise AssertionError(f"{cls}.{name} not found")


def _is_self_attr(node: ast.AST, name: str | None = None) -> bool:
    return (isinstance(node, ast.Attribute) and isinstance(node.value, ast.Name) and node.value.id == "self"
            and (name is None or node.attr == name))


def owner_calls(step: ast.FunctionDef) -> list[str]:
    """`self.<owner>.<method>(...)` calls in the step, outside `for ... in self.components` loops."""
    calls: list[str] = []

    def visit(node: ast.AST) -> None:
        if isinstance(node, ast.For) and _is_self_attr(node.iter, "components"):
            return
        if isinstance(node, ast.Call) and isinstance(node.func, ast.Attribute) and _is_self_attr(node.func.value):
            calls.append(f"{node.func.value.attr}.{node.func.attr}")
        for child in ast.iter_child_nodes(node):
            visit(child)

    for stmt in step.body:
        visit(stmt)
    return calls


def component_loops(step: ast.FunctionDef) -> int:
    return sum(isinstance(n, ast.For) and _is_self_attr(n.iter, "components") for n in ast.walk(step))


def test_the_step_is_three_owner_calls_and_the_component_loops():
    step = _function(_tree("engine/core.py"), "EngineCore", "step")
    calls = owner_calls(step)
    assert len(calls) <= 3, f"EngineCore.step calls {len(calls)} owners: {calls}"
    assert calls == ["scheduler.schedule", "executor.execute", "output.update_from_output"], calls
    assert component_loops(step) >= 1


def test_the_owner_call_count_sees_a_step_that_calls_owners_directly():
    """The check above fails for a step written as a list of owner calls (this repository's step before the step
    components)."""
    old = ast.parse('''
def step(self):
    self.lossless.before_schedule(self.scheduler.running)
    sched = self.scheduler.schedule()
    result = self.runner.execute(sched.forward)
    self.scheduler.update_from_output(sched, result)
    sampled = self.sampler.sample(*self.lossless.draft(result.sample_seqs, result.logits))
''').body[0]
    assert len(owner_calls(old)) == 6 and component_loops(old) == 0


def _method_names(tree: ast.Module) -> set[str]:
    return {n.name for n in ast.walk(tree) if isinstance(n, (ast.FunctionDef, ast.AsyncFunctionDef))}


def callable_wiring(tree: ast.Module) -> list[str]:
    """Assignments of a callable (a lambda, a method of this class, or a method of one of its owners) to an
    attribute of another owner: one this object holds (`self.owner.hook = ...`) or one it was handed
    (`runner.on_plan = self.on_plan` with `runner` a parameter). Local objects being built are not owners."""
    methods = _method_names(tree)
    found = []
    for fn in ast.walk(tree):
        if not isinstance(fn, (ast.FunctionDef, ast.AsyncFunctionDef)):
            continue
        params = {a.arg for a in fn.args.args + fn.args.kwonlyargs} - {"self"}
        for node in ast.walk(fn):
            if not isinstance(node, ast.Assign):
                continue
            value = node.value
            is_callable = (isinstance(value, ast.Lambda)
                           or (_is_self_attr(value) and value.attr in methods)
                           or (isinstance(value, ast.Attribute) and _is_self_attr(value.value)))
            if not is_callable:
                continue
            for target in node.targets:
                if not isinstance(target, ast.Attribute):
                    continue
                held = _is_self_attr(target.value)  # self.owner.hook
                handed = isinstance(target.value, ast.Name) and target.value.id in params  # param.hook
                if held or handed:
                    found.append(f"line {node.lineno}: {ast.unparse(target)} = {ast.unparse(value)[:40]}")
    return found


def test_no_owner_is_wired_by_assigning_a_callable_to_another_owners_attribute():
    found = {}
    for package in PRODUCT:
        for path in sorted((ROOT / package).rglob("*.py")):
            rel = str(path.relative_to(ROOT))
            hits = callable_wiring(_tree(rel))
            if hits:
                found[rel] = hits
    assert not found, found


def test_the_wiring_check_sees_the_old_wiring():
    old = ast.parse('''
class EngineCore:
    def _build(self):
        self.lossless.append = self.output.append
        self.lossless.preempt = lambda seq: self.scheduler.preempt(seq, swap=False)

class TPDriver:
    def attach(self, runner, stage):
        runner.on_plan = self.on_plan
        stage.round_hook = self.on_round
    def on_plan(self): ...
    def on_round(self): ...
''')
    assert len(callable_wiring(old)) == 4
    fine = ast.parse("def f(self, seq):\n    seq.status = Status.WAITING\n    self.hook = self.other.method\n"
                     "    plan = Plan()\n    plan.make = lambda: 1\n    s = Stats()\n    s.n = self.kv.n\n")
    assert callable_wiring(fine) == []


def _imports(tree: ast.Module) -> set[str]:
    out = set()
    for node in ast.walk(tree):
        if isinstance(node, ast.Import):
            out.update(a.name for a in node.names)
        elif isinstance(node, ast.ImportFrom) and node.module:
            out.add(node.module)
    return out


def test_the_scheduler_imports_no_model_runner_and_no_compression():
    imported = _imports(_tree("engine/scheduler.py"))
    bad = sorted(m for m in imported if m == "engine.model_runner" or m.split(".")[0] == "compression")
    assert not bad, bad


def test_the_scheduler_never_runs_a_forward_or_a_round():
    """It takes no callable at construction: reclaim is a decision (`Scheduler.shortage`) the engine acts on."""
    init = _function(_tree("engine/scheduler.py"), "Scheduler", "__init__")
    params = [a.arg for a in init.args.args + init.args.kwonlyargs]
    assert "reclaim" not in params, params
