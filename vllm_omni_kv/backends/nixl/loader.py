"""Loading NIXL: its Python API from whichever wheel is installed, the UCX module
settings a host without RDMA devices needs before the first agent starts, and agents
whose progress thread sleeps between events (:func:`make_agent`)."""

from __future__ import annotations

import logging
import os
import sys
import threading
from typing import Any

from vllm_omni_kv.errors import BackendUnavailable
from vllm_omni_kv.logger import init_logger

logger = init_logger(__name__)

#: the longest NIXL's progress thread waits for its UCX workers' events (µs; NIXL's UCX
#: plugin rounds it up to whole milliseconds); it wakes at once on traffic, so this bounds
#: only transports without wake-up events
PROGRESS_WAIT_US = 1000

INSTALL_HINT = "pip install 'vllm-omni-kv[nixl]' (or: pip install nixl)"


def skip_unused_rdma_modules() -> bool:
    """On a host without RDMA devices, keep UCX from loading its InfiniBand modules.

    NIXL's wheel bundles its own libibverbs / libnl; with the system's rdma-core also
    installed (Mooncake needs ``libibverbs1``) both copies of ``libnl-route`` get loaded
    and the process segfaults in their destructors at exit. The modules serve nothing
    without a device, so unless ``UCX_MODULES`` is set, ``^ib,rdmacm`` is set for this
    process (before its first agent starts). True when it was set here.
    """
    if os.environ.get("UCX_MODULES") or os.path.isdir("/sys/class/infiniband"):
        return False
    os.environ["UCX_MODULES"] = "^ib,rdmacm"
    return True


def import_nixl() -> tuple[Any, Any, Any]:
    """``(nixl_agent, nixl_agent_config, nixl_thread_sync_t)``, or ``BackendUnavailable``.

    NIXL logs each agent's start at INFO on stdout; unless ``NIXL_LOG_LEVEL`` says
    otherwise, only its warnings are shown (stdout may carry JSON, e.g. ``doctor --json``).
    """
    try:
        from nixl._api import nixl_agent, nixl_agent_config, nixl_thread_sync_t
    except ImportError:
        try:  # the CUDA-12 build installed without the ``nixl`` meta package
            from nixl_cu12._api import nixl_agent, nixl_agent_config, nixl_thread_sync_t
        except ImportError as e:
            raise BackendUnavailable(
                f"NIXL is not importable ({e}); install it with: {INSTALL_HINT}"
            ) from e
    skip_unused_rdma_modules()
    if not os.environ.get("NIXL_LOG_LEVEL"):
        logging.getLogger("nixl").setLevel(logging.WARNING)
    return nixl_agent, nixl_agent_config, nixl_thread_sync_t


_swap_lock = threading.Lock()


class _Bindings:
    """NIXL's binding module with ``nixlAgentConfig`` replaced (everything else is its)."""

    def __init__(self, real: Any, config_cls: type) -> None:
        self._real, self.nixlAgentConfig = real, config_cls

    def __getattr__(self, name: str) -> Any:
        return getattr(self._real, name)


def _waiting_config(base: type, wait_us: int) -> type:
    """A subclass of NIXL's agent config whose progress-thread delay is at least
    ``wait_us`` whatever the Python API assigns."""
    field = base.__dict__["pthrDelay"]

    def get(self: Any) -> int:
        return int(field.__get__(self))

    def put(self: Any, value: int) -> None:
        field.__set__(self, max(int(value), wait_us))

    return type("WaitingAgentConfig", (base,), {"pthrDelay": property(get, put)})


def make_agent(agent_cls: Any, name: str, conf: Any, wait_us: int = PROGRESS_WAIT_US) -> Any:
    """``agent_cls(name, conf)`` whose UCX progress thread waits up to ``wait_us`` for
    events between rounds (``0``: NIXL's own behaviour).

    NIXL's Python API builds every agent with a progress-thread delay of 0, which its
    UCX plugin turns into a zero ``poll`` timeout: the thread spins, a whole core per
    agent even when idle (measured on NIXL 1.5.1). The agent's configuration is built
    inside its constructor, so this passes a subclass of the binding's config class for
    that one call.
    """
    # the module whose globals the constructor reads (a subclass may live elsewhere)
    module = sys.modules.get(getattr(agent_cls.__init__, "__module__", ""))
    with _swap_lock:  # every read and swap of the module's bindings under the lock
        real = getattr(module, "nixlBind", None)
        if isinstance(real, _Bindings):  # left by a swap outside this lock: the real module
            real = real._real
        base = getattr(real, "nixlAgentConfig", None)
        if wait_us <= 0 or not isinstance(base, type) or "pthrDelay" not in base.__dict__:
            if wait_us > 0:
                logger.warning(
                    "this NIXL build's agent config has no progress-thread delay: its "
                    "progress thread busy-polls (a core per agent)"
                )
            return agent_cls(name, conf)
        module.nixlBind = _Bindings(real, _waiting_config(base, wait_us))  # type: ignore[union-attr]
        try:
            return agent_cls(name, conf)
        finally:
            module.nixlBind = real  # type: ignore[union-attr]
