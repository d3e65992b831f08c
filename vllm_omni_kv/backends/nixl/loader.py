"""Loading NIXL: its Python API from whichever wheel is installed, and the UCX module
settings a host without RDMA devices needs before the first agent starts."""

from __future__ import annotations

import logging
import os
from typing import Any

from vllm_omni_kv.errors import BackendUnavailable

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
