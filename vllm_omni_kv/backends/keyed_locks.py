"""A lock per key (a peer, a session), listed only while a thread holds or waits for it:
keys a peer names leave nothing behind once their work ends."""

from __future__ import annotations

import contextlib
import threading
from collections.abc import Iterator


class _Entry:
    def __init__(self) -> None:
        self.lock = threading.Lock()
        self.users = 0  # threads holding or waiting for ``lock``


class KeyedLocks:
    """One lock per key; a key's entry lives while a thread holds or waits for it."""

    def __init__(self) -> None:
        self._locks: dict[str, _Entry] = {}
        self._lock = threading.Lock()

    def __len__(self) -> int:
        with self._lock:
            return len(self._locks)

    @contextlib.contextmanager
    def held(self, key: str) -> Iterator[None]:
        """Hold ``key``'s lock (waiting for the thread holding it)."""
        with self._lock:
            entry = self._locks.setdefault(key, _Entry())
            entry.users += 1
        try:
            with entry.lock:
                yield
        finally:
            with self._lock:
                entry.users -= 1
                if not entry.users:
                    del self._locks[key]
