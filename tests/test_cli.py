"""The CLI package's shape: command modules share only `common`, one default store path, two consoles."""

from __future__ import annotations

import ast
from pathlib import Path

from ddlscope.cli import COMMANDS

SRC = Path(__file__).resolve().parents[1] / "src"
CLI_DIR = SRC / "ddlscope" / "cli"
SHARED = {"__init__", "common"}  # what command modules may import from the package


def _imported_modules(path: Path) -> set[str]:
    """Every module an import statement in `path` names, as `from a.b import c` -> a.b and a.b.c."""
    names: set[str] = set()
    for node in ast.walk(ast.parse(path.read_text())):
        if isinstance(node, ast.Import):
            names.update(alias.name for alias in node.names)
        elif isinstance(node, ast.ImportFrom):
            base = node.module or ""
            if node.level:  # relative: `from . import run` / `from .run import x`
                base = "ddlscope.cli" + (f".{base}" if base else "")
            names.add(base)
            names.update(f"{base}.{alias.name}" for alias in node.names)
    return names


def test_command_modules_import_no_sibling_command_module():
    modules = {p.stem for p in CLI_DIR.glob("*.py")}
    commands = modules - SHARED
    assert {"run", "predict", "advise", "calibrate", "report"} <= commands
    for name in sorted(commands | {"common"}):
        imported = _imported_modules(CLI_DIR / f"{name}.py")
        siblings = {m.split(".")[2] for m in imported if m.startswith("ddlscope.cli.")}
        assert siblings <= {"common"}, f"cli/{name}.py imports {sorted(siblings - {'common'})}"


def test_every_command_function_lives_in_a_command_module():
    for name, function in COMMANDS:
        module = function.__module__.removeprefix("ddlscope.cli.")
        assert module not in SHARED, f"{name} is defined in cli/{module}.py"


def test_default_store_path_is_written_once_in_src():
    hits = [f"{p.relative_to(SRC)}:{i}" for p in SRC.rglob("*.py")
            for i, line in enumerate(p.read_text().splitlines(), 1) if "ddlscope.db" in line]
    assert len(hits) == 1 and hits[0].startswith("ddlscope/store.py:"), hits


def test_the_cli_has_one_console_per_stream():
    made = {p.name: p.read_text().count("Console(") for p in CLI_DIR.glob("*.py") if "Console(" in p.read_text()}
    assert made == {"common.py": 2}, made

