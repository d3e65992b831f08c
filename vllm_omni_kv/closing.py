"""``Closing``: the ``with`` protocol for objects that hold a resource until ``close()``."""

from __future__ import annotations

from types import TracebackType
from typing import Any


class Closing:
    """Mixin: ``with obj:`` returns ``obj`` and calls ``obj.close()`` on exit."""

    def close(self) -> None:
        raise NotImplementedError

    def __enter__(self) -> Any:
        return self

    def __exit__(
        self,
        exc_type: type[BaseException] | None,
        exc: BaseException | None,
        tb: TracebackType | None,
    ) -> None:
        self.close()
