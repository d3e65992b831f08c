"""The spans a receive stream holds, checked against a set of byte offsets (engine-free)."""

from __future__ import annotations

import random

import pytest

from vllm_omni_kv.backends.pull.held_spans import HeldSpans


def _runs(offsets: set[int], start: int, end: int) -> list[tuple[int, int]]:
    """Maximal runs of ``[start, end)`` not in ``offsets`` (the model of ``missing``)."""
    out: list[tuple[int, int]] = []
    for x in range(start, end):
        if x in offsets:
            continue
        if out and out[-1][1] == x:
            out[-1] = (out[-1][0], x + 1)
        else:
            out.append((x, x + 1))
    return out


@pytest.mark.parametrize("seed", range(40))
def test_missing_and_add_match_a_set_of_bytes(seed: int) -> None:
    rng = random.Random(seed)
    size = rng.choice([8, 64, 300])
    held, model = HeldSpans(), set()
    for _ in range(60):
        a, b = rng.randint(-5, size + 5), rng.randint(-5, size + 5)
        if rng.random() < 0.2:
            a, b = b, a  # empty or reversed ranges too
        assert held.missing(a, b) == _runs(model, a, b), (a, b, held.spans())
        if rng.random() < 0.6:
            held.add(a, b)
            model.update(range(a, b))
        spans = held.spans()
        assert all(s < e for s, e in spans)
        assert all(e1 < s2 for (_s1, e1), (s2, _e2) in zip(spans, spans[1:])), spans
        assert {x for s, e in spans for x in range(s, e)} == model


def test_many_separate_runs_stay_separate_until_joined() -> None:
    """Every other page pulled, then the rest: 1,000 spans, then one."""
    held = HeldSpans()
    for i in range(0, 2000, 2):
        held.add(i * 10, i * 10 + 10)
    assert len(held) == 1000
    assert held.missing(0, 40) == [(10, 20), (30, 40)]
    for i in range(1, 2000, 2):
        held.add(i * 10, i * 10 + 10)
    assert held.spans() == [(0, 20000)] and held.missing(0, 20000) == []
