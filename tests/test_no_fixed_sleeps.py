"""No test sleeps for a guessed time: it polls a condition (`tests.support.waiting.wait_for`) or injects a clock.
This scans every Python file under tests/ (tests/bench too) with `ast` and names each fixed sleep it finds."""

from __future__ import annotations

import ast
from pathlib import Path

TESTS = Path(__file__).resolve().parent

# Where a sleep is the point, as (file under tests/, enclosing function); each says why.
ALLOWED: dict[tuple[str, str], str] = {
    ("support/waiting.py", "_run"): "the poller itself: it sleeps between tries of its condition",
    ("support/waiting.py", "_run_async"): "the poller itself, on an event loop",
    ("gateway/test_links.py", "_block_the_event_loop"): "blocks the event loop on purpose: the busy loop under test",
    ("gateway/test_liveness.py", "_beat"): "a fake executor's liveness beacon: its period is what it simulates",
    ("bench/fake_vllm_driver.py", "main"): "a child program standing in for vLLM's driver: it simulates a slow load",
    ("bench/fake_vllm_cli.py", "do_POST"): "a child program standing in for `vllm serve`: it paces its tokens",
    ("bench/fake_vllm_cli.py", "bench_serve"): "a child program standing in for `vllm bench serve`: request arrivals",
}

SLEEPERS = {"time": {"sleep"}, "asyncio": {"sleep"}, "trio": {"sleep"}, "anyio": {"sleep"}}
EVENT_TYPES = {"Event", "Condition", "Barrier"}


def _is_zero(node: ast.expr) -> bool:
    """`asyncio.sleep(0)` hands the event loop over without waiting: a yield, not a sleep."""
    return isinstance(node, ast.Constant) and node.value == 0


class _Finder(ast.NodeVisitor):
    def __init__(self) -> None:
        self.modules: dict[str, str] = {}  # local name -> module, for `import time as t`
        self.functions: dict[str, str] = {}  # local name -> module, for `from time import sleep`
        self.events: set[str] = set()  # names and attributes bound to an Event (`stop`, `self.stop`)
        self.scope: list[str] = []
        self.found: list[tuple[int, str, str]] = []  # (line, enclosing function, what)

    def visit_Import(self, node: ast.Import) -> None:
        for alias in node.names:
            self.modules[alias.asname or alias.name] = alias.name

    def visit_ImportFrom(self, node: ast.ImportFrom) -> None:
        for alias in node.names:
            if node.module in SLEEPERS and alias.name in SLEEPERS[node.module]:
                self.functions[alias.asname or alias.name] = node.module

    def _function(self, node: ast.FunctionDef | ast.AsyncFunctionDef) -> None:
        self.scope.append(node.name)
        self.generic_visit(node)
        self.scope.pop()

    visit_FunctionDef = visit_AsyncFunctionDef = _function

    def visit_Assign(self, node: ast.Assign) -> None:
        if isinstance(node.value, ast.Call) and _callee_name(node.value.func) in EVENT_TYPES:
            self.events.update(ast.unparse(target) for target in node.targets)
        self.generic_visit(node)

    def visit_Expr(self, node: ast.Expr) -> None:
        # An Event's wait whose answer nobody reads is a sleep; `assert done.wait(5)` waits for a condition.
        call = node.value.value if isinstance(node.value, ast.Await) else node.value
        if isinstance(call, ast.Call) and isinstance(call.func, ast.Attribute) and call.func.attr == "wait":
            receiver = call.func.value
            is_event = ast.unparse(receiver) in self.events or (
                isinstance(receiver, ast.Call) and _callee_name(receiver.func) in EVENT_TYPES
            )
            if is_event and (call.args or call.keywords):
                self._found(call, "an Event's wait used as a sleep")
        self.generic_visit(node)

    def visit_Call(self, node: ast.Call) -> None:
        module = None
        if isinstance(node.func, ast.Attribute) and isinstance(node.func.value, ast.Name):
            module = self.modules.get(node.func.value.id)
            if module is not None and node.func.attr not in SLEEPERS.get(module, set()):
                module = None
        elif isinstance(node.func, ast.Name):
            module = self.functions.get(node.func.id)
        if module is not None and not (node.args and _is_zero(node.args[0])):
            self._found(node, f"{module}.sleep")
        self.generic_visit(node)

    def _found(self, node: ast.AST, what: str) -> None:
        self.found.append((getattr(node, "lineno", 0), self.scope[-1] if self.scope else "<module>", what))


def _callee_name(func: ast.expr) -> str | None:
    if isinstance(func, ast.Attribute):
        return func.attr
    return func.id if isinstance(func, ast.Name) else None


def fixed_sleeps(source: str) -> list[tuple[int, str, str]]:
    """(line, enclosing function, what) for every fixed sleep in one module's source."""
    finder = _Finder()
    finder.visit(ast.parse(source))
    return finder.found


def test_no_test_sleeps_for_a_fixed_time() -> None:
    found = []
    for path in sorted(TESTS.rglob("*.py")):
        name = path.relative_to(TESTS).as_posix()
        for line, function, what in fixed_sleeps(path.read_text()):
            if (name, function) not in ALLOWED:
                found.append(f"tests/{name}:{line} in {function}: {what}")
    assert not found, "fixed sleeps (poll a condition with tests.support.waiting.wait_for instead):\n" + "\n".join(
        found
    )


def test_every_allowed_sleep_is_still_there() -> None:
    """An allow-list entry whose sleep went away goes too, so the list never grants more than is needed."""
    seen = {
        (path.relative_to(TESTS).as_posix(), function)
        for path in TESTS.rglob("*.py")
        for _, function, _ in fixed_sleeps(path.read_text())
    }
    listed = set(ALLOWED)
    assert listed <= seen, sorted(listed - seen)


def test_the_scan_finds_each_kind_of_fixed_sleep() -> None:
    source = """
import asyncio, threading, time
import time as clock
from time import sleep as nap

def a():
    time.sleep(0.3)
    clock.sleep(1)
    nap(2)

async def b():
    await asyncio.sleep(0.3)
    await asyncio.sleep(0)  # a yield: allowed
    stop = threading.Event()
    stop.wait(0.5)
    threading.Event().wait(timeout=1)
    assert stop.wait(5)  # a bounded wait for a condition: allowed
"""
    assert [(line, function) for line, function, _ in fixed_sleeps(source)] == [
        (7, "a"),
        (8, "a"),
        (9, "a"),
        (12, "b"),
        (15, "b"),
        (16, "b"),
    ]
