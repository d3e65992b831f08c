"""Child processes for tests: forked from a server that imported torch once per test process.

``CTX`` replaces ``multiprocessing.get_context("spawn")`` in tests whose children import torch
(a fresh interpreter pays that import each time: seconds per child on a busy 2-core machine).
Children still start from a clean interpreter state (the fork server never ran a test), and
each child gets the environment of its parent at ``Process()`` time, as with spawn; only the
modules in :data:`PRELOAD` come from the server, imported with the environment it started in.
"""

from __future__ import annotations

import multiprocessing as mp
import os
from collections.abc import Callable, Mapping
from multiprocessing.context import ForkServerContext, ForkServerProcess
from typing import Any

#: imported once by the fork server; nothing here reads an OMNIKV_* variable at import
PRELOAD = ["torch", "numpy"]


def _in_env(
    env: Mapping[str, str],
    target: Callable[..., Any],
    args: tuple[Any, ...],
    kwargs: dict[str, Any],
) -> None:
    os.environ.clear()
    os.environ.update(env)
    target(*args, **kwargs)


class EnvProcess(ForkServerProcess):
    """A fork-server child that runs ``target`` in its parent's environment of now."""

    def __init__(
        self,
        group: None = None,
        target: Callable[..., Any] | None = None,
        name: str | None = None,
        args: tuple[Any, ...] = (),
        kwargs: Mapping[str, Any] | None = None,
        *,
        daemon: bool | None = None,
    ) -> None:
        if target is None:
            raise TypeError("EnvProcess needs a target")
        wrapped = (dict(os.environ), target, tuple(args), dict(kwargs or {}))
        super().__init__(group, _in_env, name, wrapped, {}, daemon=daemon)


class _EnvForkServerContext(ForkServerContext):
    Process = EnvProcess  # type: ignore[assignment]


CTX = _EnvForkServerContext()
CTX.set_forkserver_preload(PRELOAD)
assert isinstance(CTX, mp.context.BaseContext)
