"""Fixtures shared by the backend tests."""

from __future__ import annotations

from collections.abc import Iterator

import pytest
from _kv_fixtures import shm_namespace


@pytest.fixture
def ns(request: pytest.FixtureRequest) -> Iterator[str]:
    """A fresh shared-memory namespace named after the test module. Files left in it are
    removed after the test, and fail it unless the module sets ``NS_MAY_LEAVE_FILES``
    (tests that plant files on purpose)."""
    prefix = request.module.__name__.rsplit(".", 1)[-1].removeprefix("test_")
    strict = not getattr(request.module, "NS_MAY_LEAVE_FILES", False)
    with shm_namespace(prefix, strict) as name:
        yield name
