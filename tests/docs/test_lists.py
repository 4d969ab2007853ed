"""The lists in the docs that the code defines: error codes, ops, modules, test helpers, console scripts, metrics,
options and environment variables.

Each test reads a list from the docs and the same list from the code, so neither can change alone.
"""

from __future__ import annotations

import ast
import importlib
import re
import tomllib
from pathlib import Path

import click

from blockd import protocol
from blockd.errors import ErrorCode
from executor.protocol import RejectCode

ROOT = Path(__file__).resolve().parents[2]
ARCHITECTURE = (ROOT / "docs" / "architecture.md").read_text()
README = (ROOT / "README.md").read_text()
SCRIPTS: dict[str, str] = tomllib.loads((ROOT / "pyproject.toml").read_text())["project"]["scripts"]
# Options of other programs the docs show (kubectl, pip, make's ruff): not ours to check.
FOREIGN_OPTIONS = {"--from-file", "--no-deps", "--check", "--help"}


def _span(text: str, start: str, end: str) -> str:
    """The text between the first `start` and the next `end` after it."""
    head = text.index(start) + len(start)
    return text[head : text.index(end, head)]


def _without_parentheses(text: str) -> str:
    """Asides dropped (they name options and messages, not codes), nested ones too."""
    out, depth = [], 0
    for ch in text:
        depth += ch == "("
        if not depth:
            out.append(ch)
        depth -= ch == ")" and depth > 0
    return "".join(out)


def _codes(text: str) -> set[str]:
    return set(re.findall(r"`([a-z_]+)`", _without_parentheses(text)))


def _code_literals(package: str, raisers: set[str]) -> dict[str, str]:
    """code -> a module using it: every string given as `code=...`, or first to one of `raisers`, in a package."""
    found: dict[str, str] = {}
    for path in sorted((ROOT / package).glob("*.py")):
        for node in ast.walk(ast.parse(path.read_text())):
            if not isinstance(node, ast.Call):
                continue
            values = [k.value for k in node.keywords if k.arg == "code"]
            name = node.func.attr if isinstance(node.func, ast.Attribute) else getattr(node.func, "id", "")
            if name in raisers and node.args:
                values.append(node.args[0])
            for value in values:
                if isinstance(value, ast.Constant) and isinstance(value.value, str):
                    found.setdefault(value.value, path.name)
    return found


def _table_names(section: str) -> set[str]:
    """The `name.py` files named in the first column of the markdown table under a heading."""
    table = _span(ARCHITECTURE, section, "\n\n")
    return {name for row in table.splitlines()[2:] for name in re.findall(r"`(\w+\.py)`", row.split("|")[1])}


def _command(script: str) -> click.Command:
    module, name = SCRIPTS[script].split(":")
    return getattr(importlib.import_module(module), name)


def _options(command: click.Command, name: str, parent: click.Context | None = None) -> set[str]:
    """Every option of a command and its subcommands (lazy ones imported)."""
    ctx = click.Context(command, info_name=name, parent=parent)
    found = {opt for param in command.params for opt in (*param.opts, *param.secondary_opts)}
    if isinstance(command, click.Group):
        for sub in command.list_commands(ctx):
            found |= _options(command.get_command(ctx, sub), sub, ctx)
    return found


def test_blockd_error_codes_are_the_documented_ones() -> None:
    documented = _codes(_span(ARCHITECTURE, "Errors carry a stable `code` —", "— and a message"))
    assert documented == {code.value for code in ErrorCode}


def test_executor_rejection_codes_are_the_documented_ones() -> None:
    documented = _codes(_span(ARCHITECTURE, "`rejected` (request id, stable code:", ", and a message)"))
    assert documented == {code.value for code in RejectCode}


def test_executor_rejects_only_with_its_codes() -> None:
    used = _code_literals("executor", {"RequestRejected", "Rejected"})
    assert {code: module for code, module in used.items() if code not in set(RejectCode)} == {}


def test_gateway_error_codes_are_the_documented_ones() -> None:
    documented = _codes(_span(ARCHITECTURE, "with a\nstable `code` where one applies:", "Other\nrefusals"))
    used = _code_literals("gateway", set())
    assert documented == set(used), f"in the code: {used}"


def test_every_executor_and_gateway_module_is_in_its_table() -> None:
    for package, heading in (("executor", "| module | job |"), ("gateway", "| module | its one job |")):
        modules = {p.name for p in (ROOT / package).glob("*.py") if p.name != "__init__.py"}
        assert _table_names(heading) == modules, package


def test_every_blockd_module_is_named_in_its_section() -> None:
    section = _span(ARCHITECTURE, "\n## blockd\n", "\n## executor\n")
    modules = {p.name for p in (ROOT / "blockd").glob("*.py") if p.name != "__init__.py"}
    assert {name for name in modules if f"blockd/{name}" not in section} == set()


def test_every_test_support_file_is_named() -> None:
    row = next(line for line in ARCHITECTURE.splitlines() if line.startswith("| `tests/` |"))
    named = set(re.findall(r"`(\w+\.py)`", _span(row, "`tests/support/` (", "|")))
    assert named == {p.name for p in (ROOT / "tests" / "support").glob("*.py") if p.name != "__init__.py"}


def test_every_console_script_is_named() -> None:
    packages = ARCHITECTURE[: ARCHITECTURE.index("## Ownership and truth")]
    assert {name for name in SCRIPTS if f"`{name}`" not in packages} == set()


def test_every_benchmark_and_tool_module_is_named() -> None:
    row = next(line for line in ARCHITECTURE.splitlines() if line.startswith("| `pagedkv/` |"))
    named = set(re.findall(r"`(\w+)(?:\.py)?`", row))
    for folder in ("bench", "tools"):
        modules = {p.stem for p in (ROOT / "pagedkv" / folder).glob("*.py") if p.name != "__init__.py"}
        assert modules - named == set(), folder


def test_every_common_module_is_named() -> None:
    row = next(line for line in ARCHITECTURE.splitlines() if line.startswith("| `common/` |"))
    modules = {p.stem for p in (ROOT / "common").glob("*.py") if p.name != "__init__.py"}
    assert modules - set(re.findall(r"`(\w+)`", row)) == set()


def test_every_pagedkv_command_is_in_the_readme() -> None:
    main = _command("pagedkv")
    ctx = click.Context(main, info_name="pagedkv")
    commands = {f"pagedkv {name}" for name in main.list_commands(ctx) if name != "bench"}
    bench = main.get_command(ctx, "bench")
    assert isinstance(bench, click.Group)
    commands |= {f"pagedkv bench {name}" for name in bench.list_commands(click.Context(bench, parent=ctx))}
    assert {command for command in commands if not re.search(rf"{command}\b", README)} == set()


def test_every_blockd_op_is_in_the_ops_table() -> None:
    table = _span(ARCHITECTURE, "| op | what |", "\n\n")
    documented = {op for row in table.splitlines()[2:] for op in re.findall(r"`(\w+)`", row.split("|")[1])}
    ops = {cls.__struct_config__.tag for cls in protocol.Request.__subclasses__()}
    assert documented == ops


def test_documented_metrics_are_the_exported_ones() -> None:
    # (`pagedkv_kernels` is the kernels package, not a metric)
    for module, pattern in (("blockd", r"blockd_\w+"), ("gateway", r"(?:pagedkv_(?!kernels\b)\w+|vllm:\w+)")):
        source = (ROOT / module / "metrics.py").read_text()
        exported = set(re.findall(rf'"({pattern})"', source))
        assert set(re.findall(rf"`({pattern})`", ARCHITECTURE)) == exported, module


def test_every_documented_option_is_a_real_one() -> None:
    real = set().union(*(_options(_command(script), script) for script in SCRIPTS))
    for text in (ARCHITECTURE, README):
        named = set(re.findall(r"(?<![\w-])(--[a-z][a-z0-9-]*)", text))
        assert named - real - FOREIGN_OPTIONS == set()


def test_blockds_environment_variables_are_the_listed_ones() -> None:
    listed = set(re.findall(r"`([A-Z_]+)`", _span(README, "where an operator would want one:", ")")))
    assert listed == {param.envvar for param in _command("blockd").params if param.envvar}
