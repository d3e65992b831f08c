"""The package's size rules, checked on every module: files of at most 450 lines and
functions of at most 60."""

from __future__ import annotations

import ast
from pathlib import Path

import vllm_omni_kv

PACKAGE = Path(vllm_omni_kv.__file__).parent
MAX_FILE_LINES = 450
MAX_FUNCTION_LINES = 60


def test_no_module_over_the_file_limit() -> None:
    over = {
        str(p.relative_to(PACKAGE)): n
        for p in PACKAGE.rglob("*.py")
        if (n := len(p.read_text().splitlines())) > MAX_FILE_LINES
    }
    assert not over, over


def test_no_function_over_the_function_limit() -> None:
    over = {}
    for p in PACKAGE.rglob("*.py"):
        for node in ast.walk(ast.parse(p.read_text())):
            if isinstance(node, ast.FunctionDef | ast.AsyncFunctionDef):
                n = (node.end_lineno or node.lineno) - node.lineno + 1
                if n > MAX_FUNCTION_LINES:
                    over[f"{p.relative_to(PACKAGE)}:{node.name}"] = n
    assert not over, over
