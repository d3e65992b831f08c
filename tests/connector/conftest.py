"""Fixtures of the end-to-end connector tests (helpers live in ``pd_helpers``)."""

from __future__ import annotations

import sys
from collections.abc import Iterator
from pathlib import Path

import pytest

sys.path.insert(0, str(Path(__file__).parent))

from pd_helpers import SERVE_NAMESPACE, live_arena_segment, omnikv_files  # noqa: E402
from serve_helpers import Servers, example_servers  # noqa: E402


@pytest.fixture(autouse=True)
def no_shm_leaks() -> Iterator[None]:
    """Per test: no payload may be left behind. Engines here live for a whole module, so
    their producers' arena segments (reused across requests, unlinked when the engine
    stops) are checked by :func:`engines` when the module's engines are stopped."""
    before = omnikv_files() | omnikv_files(SERVE_NAMESPACE)
    yield
    after = omnikv_files() | omnikv_files(SERVE_NAMESPACE)
    leaked = {n for n in after - before if not live_arena_segment(n)}
    assert not leaked, f"test leaked shared-memory files: {sorted(leaked)}"


@pytest.fixture(scope="session")
def example_pd(tiny_model_dir: Path) -> Iterator[Servers]:
    """One ``vllm serve`` deployment of the example configs for every module that uses it
    (test_pd_load, test_pd_serve): started once, stopped at the end of the session."""
    with example_servers(tiny_model_dir) as servers:
        yield servers
