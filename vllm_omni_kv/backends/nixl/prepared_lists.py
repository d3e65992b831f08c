"""A NIXL agent's prepared descriptor lists of page tables (``prep_xfer_dlist``).

One list per owner (a peer agent's name, or :data:`LOCAL_SIDE` for this agent's own
memory), memory kind and tuple of :class:`~vllm_omni_kv.backends.pull.page_reads.PageTable`:
one strided descriptor per table (address, page bytes, device, stride, page count), so a
move is made by index into two lists. At most :data:`MAX_DLISTS` are kept (the least
recently used one is released past it); an owner's lists are released when its memory
goes. Requests are made from the lists under the lock that releases them
(:meth:`PreparedLists.request`), so no list is released between its lookup and its use.
"""

from __future__ import annotations

import threading
from collections import OrderedDict
from collections.abc import Callable
from typing import Any

import numpy as np

from vllm_omni_kv.backends.pull.page_reads import PageTable
from vllm_omni_kv.errors import KVTransferError
from vllm_omni_kv.logger import init_logger

logger = init_logger(__name__)

#: prepared descriptor lists kept at most (the least recently used one is released past it)
MAX_DLISTS = 64
#: ``prep_xfer_dlist``'s agent name for this agent's own memory (the local side)
LOCAL_SIDE = "NIXL_INIT_AGENT"

Key = tuple[str, tuple[str, int], tuple[PageTable, ...]]


class PreparedLists:
    """The prepared lists of one agent (passed to each call: tests may wrap it)."""

    def __init__(self) -> None:
        self._lock = threading.Lock()
        self._lists: OrderedDict[Key, Any] = OrderedDict()

    def get(
        self, agent: Any, owner: str, kind: tuple[str, int], tables: tuple[PageTable, ...]
    ) -> Any:
        """The list of ``tables`` in ``owner``'s memory of ``kind`` (memory type, device),
        prepared on first use (outside the lock: preparing takes a while)."""
        key = (owner, kind, tables)
        with self._lock:
            if key in self._lists:
                self._lists.move_to_end(key)
                return self._lists[key]
        handle = _prepare(agent, key)
        with self._lock:
            if key in self._lists:  # another thread prepared it meanwhile
                _release(agent, handle)
                return self._lists[key]
            self._keep_locked(agent, key, handle)
        return handle

    def _keep_locked(self, agent: Any, key: Key, handle: Any) -> None:
        self._lists[key] = handle
        while len(self._lists) > MAX_DLISTS:
            _release(agent, self._lists.popitem(last=False)[1])

    def request(self, agent: Any, sides: list[Key], make: Callable[[list[Any]], Any]) -> Any:
        """``make(lists)``: a request made from the lists of ``sides`` under the lock, so
        that none is released while it is made. A list another thread released after it
        was prepared here (evicted, or its owner dropped) is prepared again, under the lock."""
        for owner, kind, tables in sides:
            self.get(agent, owner, kind, tables)
        with self._lock:
            lists = []
            for key in sides:
                handle = self._lists.get(key)
                if handle is None:
                    handle = _prepare(agent, key)
                    self._keep_locked(agent, key, handle)
                self._lists.move_to_end(key)  # the newest: none of these is evicted here
                lists.append(handle)
            return make(lists)

    def drop(self, agent: Any, owner: str) -> None:
        """Release ``owner``'s lists (its memory was unregistered, or it was forgotten)."""
        with self._lock:
            for key in [k for k in self._lists if k[0] == owner]:
                _release(agent, self._lists.pop(key))

    def close(self, agent: Any) -> None:
        """Release every list."""
        with self._lock:
            lists, self._lists = list(self._lists.values()), OrderedDict()
        for h in lists:
            _release(agent, h)


def _prepare(agent: Any, key: Key) -> Any:
    owner, kind, tables = key
    rows = np.array([t.row(kind[1]) for t in tables], dtype=np.uint64)
    try:
        return agent.prep_xfer_dlist(owner, rows, kind[0])
    except Exception as e:
        raise KVTransferError(
            f"NIXL could not prepare {len(tables)} page tables of {kind[0]} memory on "
            f"{owner!r}: {e}"
        ) from None


def _release(agent: Any, handle: Any) -> None:
    try:
        agent.release_dlist_handle(handle)
    except Exception as e:
        logger.debug("releasing a prepared NIXL descriptor list: %s", e)
