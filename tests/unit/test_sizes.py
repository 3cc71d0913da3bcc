"""Short modules and short functions, as docs/development.md asks: no Python file of the repository (tests
included) over 600 lines, no function over 100. A file that grows past them is split by topic."""

from __future__ import annotations

import ast
import subprocess

from paths import REPO

MAX_MODULE_LINES = 600
MAX_FUNCTION_LINES = 100


def python_files() -> list[str]:
    listed = subprocess.run(["git", "ls-files", "*.py"], cwd=REPO, capture_output=True, text=True, check=True)
    return [path for path in listed.stdout.splitlines() if (REPO / path).is_file()]


def test_no_module_is_over_600_lines_and_no_function_over_100():
    files = python_files()
    assert len(files) > 100, files  # the listing worked
    long_modules, long_functions = [], []
    for path in files:
        source = (REPO / path).read_text()
        if (lines := len(source.splitlines())) > MAX_MODULE_LINES:
            long_modules.append(f"{path}: {lines} lines")
        nodes = ast.walk(ast.parse(source))
        functions = [n for n in nodes if isinstance(n, ast.FunctionDef | ast.AsyncFunctionDef)]
        long_functions += [
            f"{path}:{f.lineno} {f.name}: {f.end_lineno - f.lineno + 1} lines"
            for f in functions
            if f.end_lineno - f.lineno + 1 > MAX_FUNCTION_LINES
        ]
    assert not long_modules, long_modules
    assert not long_functions, long_functions
