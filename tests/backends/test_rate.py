"""The token bucket that bounds what peers make a server do (side-channel requests, NIXL
metadata loads)."""

from __future__ import annotations

import time

from vllm_omni_kv.backends.rate import TokenBucket


def test_a_burst_then_the_rate() -> None:
    bucket = TokenBucket(rate=0.0, burst=3)
    assert [bucket.take() for _ in range(4)] == [True, True, True, False]
    bucket = TokenBucket(rate=100.0, burst=1)
    assert bucket.take() and not bucket.take()
    time.sleep(0.05)  # 5 tokens' worth, kept up to the burst of 1
    assert bucket.take() and not bucket.take()


def test_a_charge_takes_what_is_left_and_never_goes_below_empty() -> None:
    bucket = TokenBucket(rate=0.0, burst=2)
    for _ in range(5):
        bucket.charge()
    assert not bucket.take()
