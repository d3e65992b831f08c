"""The byte spans of a frame a receive stream already holds, so that none is pulled twice.

Spans are kept sorted and disjoint in two parallel lists (starts, ends). Finding what is
missing from a range and recording a pulled range locate their place by bisection and
touch only the spans they overlap, so a load of many separate runs costs in proportion to
its runs, not to their square.
"""

from __future__ import annotations

from bisect import bisect_left, bisect_right

Span = tuple[int, int]


class HeldSpans:
    """Sorted, disjoint ``[start, end)`` spans; touching ones are merged."""

    def __init__(self) -> None:
        self._starts: list[int] = []
        self._ends: list[int] = []

    def __len__(self) -> int:
        return len(self._starts)

    def spans(self) -> list[Span]:
        return list(zip(self._starts, self._ends, strict=True))

    def missing(self, start: int, end: int) -> list[Span]:
        """The parts of ``[start, end)`` not held (sorted, disjoint; empty when held)."""
        out: list[Span] = []
        at = start
        i = bisect_right(self._ends, start)  # the first span ending after ``start``
        while at < end and i < len(self._starts) and self._starts[i] < end:
            if self._starts[i] > at:
                out.append((at, self._starts[i]))
            at = max(at, self._ends[i])
            i += 1
        if at < end:
            out.append((at, end))
        return out

    def add(self, start: int, end: int) -> None:
        """Hold ``[start, end)`` too (merged with the spans it overlaps or touches)."""
        if end <= start:
            return
        i = bisect_left(self._ends, start)  # the first span ending at or after ``start``
        j = bisect_right(self._starts, end)  # past the last span starting at or before ``end``
        if i < j:
            start, end = min(start, self._starts[i]), max(end, self._ends[j - 1])
        self._starts[i:j] = [start]
        self._ends[i:j] = [end]
