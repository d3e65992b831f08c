"""The connector talks to backends only through the transfer session's typed port: no
``session.backend`` and no ``getattr`` on a backend, session or region anywhere in
``vllm_omni_kv/connector`` (the import contract in pyproject.toml covers imports)."""

from __future__ import annotations

import ast
from pathlib import Path

import pytest

import vllm_omni_kv.connector as connector_pkg

MODULES = sorted(Path(connector_pkg.__file__).parent.glob("*.py"))
#: names of objects that belong to the transport layers
TRANSPORT_NAMES = ("backend", "session", "region")


def _name(node: ast.AST) -> str:
    if isinstance(node, ast.Name):
        return node.id
    if isinstance(node, ast.Attribute):
        return node.attr
    return ""


def _violations(tree: ast.AST) -> list[str]:
    found = []
    for node in ast.walk(tree):
        if isinstance(node, ast.Attribute) and node.attr == "backend":
            if "session" in _name(node.value).lower():
                found.append(f"line {node.lineno}: {ast.unparse(node)}")
        if (
            isinstance(node, ast.Call)
            and _name(node.func) in ("getattr", "hasattr")
            and node.args
            and any(t in _name(node.args[0]).lower() for t in TRANSPORT_NAMES)
        ):
            found.append(f"line {node.lineno}: {ast.unparse(node)}")
    return found


@pytest.mark.parametrize("path", MODULES, ids=lambda p: p.name)
def test_connector_module_uses_the_port_only(path: Path) -> None:
    assert not _violations(ast.parse(path.read_text())), path.name


def test_the_check_catches_what_it_forbids() -> None:
    bad = ast.parse(
        "x = self.session.backend.health()\n"
        "p = getattr(backend, 'zmq_port', 0)\n"
        "v = getattr(self.session, 'verify', True)\n"
        "ok = getattr(vllm_config, 'kv_transfer_config', None)\n"
    )
    assert sorted(v.split(":")[0] for v in _violations(bad)) == ["line 1", "line 2", "line 3"]
