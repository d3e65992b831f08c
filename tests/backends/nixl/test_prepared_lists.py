"""Prepared descriptor lists (:class:`~vllm_omni_kv.backends.nixl.prepared_lists.PreparedLists`),
engine-free: a request is made from lists no other thread can release between their
lookup and their use, while other threads evict lists (more than ``MAX_DLISTS`` in use)
and drop a peer's. The agent is a stand-in that records each list's release: a request
made from a released list reads freed native memory in NIXL, which a real agent shows
only at random (an error, or a crash).
"""

from __future__ import annotations

import threading
from typing import Any

from vllm_omni_kv.backends.nixl.prepared_lists import LOCAL_SIDE, MAX_DLISTS, PreparedLists
from vllm_omni_kv.backends.pull.page_reads import PageTable

KIND = ("DRAM", 0)


class _List:
    released = False


class _Agent:
    def __init__(self) -> None:
        self.misuse = 0

    def prep_xfer_dlist(self, owner: str, rows: Any, mem: str) -> _List:
        return _List()

    def release_dlist_handle(self, handle: _List) -> None:
        handle.released = True

    def make(self, lists: list[_List]) -> int:
        self.misuse += sum(h.released for h in lists)
        return len(lists)


def _tables(i: int) -> tuple[PageTable, ...]:
    return (PageTable(4096 * i, 4096, 4096, 1 + i),)


def test_no_list_is_released_between_its_lookup_and_the_request_made_from_it() -> None:
    agent, prepared = _Agent(), PreparedLists()
    sides = [(LOCAL_SIDE, KIND, _tables(0)), ("peer", KIND, _tables(1))]
    stop = threading.Event()

    def churn() -> None:
        i = 2
        while not stop.is_set():
            prepared.get(agent, LOCAL_SIDE, KIND, _tables(i % (4 * MAX_DLISTS) + 2))
            if i % 7 == 0:
                prepared.drop(agent, "peer")
            i += 1

    others = [threading.Thread(target=churn) for _ in range(2)]
    for t in others:
        t.start()
    try:
        made = [prepared.request(agent, sides, agent.make) for _ in range(2000)]
    finally:
        stop.set()
        for t in others:
            t.join()
        prepared.close(agent)
    assert made == [2] * 2000
    assert agent.misuse == 0
