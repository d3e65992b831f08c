"""Thread-safe counters behind every backend's ``health()``."""

from __future__ import annotations

import threading


class Counters:
    """Named integer counters; ``add`` is safe from any thread."""

    def __init__(self, *names: str) -> None:
        self._lock = threading.Lock()
        self._values: dict[str, int] = dict.fromkeys(names, 0)

    def add(self, name: str, n: int = 1) -> None:
        with self._lock:
            self._values[name] = self._values.get(name, 0) + n

    def snapshot(self) -> dict[str, int]:
        with self._lock:
            return dict(self._values)


#: the counters every backend reports
COMMON = ("puts", "gets", "misses", "bytes_put", "bytes_got")
