"""Work run on several threads at once, its failures collected for the test's thread."""

from __future__ import annotations

import threading
from collections.abc import Callable


def errors_in_threads(
    work: Callable[[int], None], n: int, timeout: float = 60.0
) -> list[BaseException]:
    """Run ``work(i)`` for each ``i`` in ``range(n)``, each on its own thread, all at once;
    return what they raised (a thread still running after ``timeout`` seconds counts as a
    ``TimeoutError``)."""
    errors: list[BaseException] = []

    def run(i: int) -> None:
        try:
            work(i)
        except BaseException as e:
            errors.append(e)

    threads = [threading.Thread(target=run, args=(i,), daemon=True) for i in range(n)]
    for t in threads:
        t.start()
    for t in threads:
        t.join(timeout)
        if t.is_alive():
            errors.append(TimeoutError(f"{t.name} still running after {timeout:g}s"))
    return errors
