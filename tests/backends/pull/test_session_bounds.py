"""An engine session a peer names (an ``acquire`` reply, a registered-cache payload's
descriptor) is at most ``MAX_SESSION`` characters, and what a consumer keeps per
producer session (its newest generation) is bounded."""

from __future__ import annotations

from types import SimpleNamespace
from typing import Any, cast

import pytest

from vllm_omni_kv.backends.pull import cache_region
from vllm_omni_kv.backends.pull.cache_region import TECacheRegion
from vllm_omni_kv.backends.pull.pull import PullTransferConnector
from vllm_omni_kv.backends.pull.pull_stream import MAX_SESSION, block_of, is_session
from vllm_omni_kv.backends.pull.puller import PullFailed
from vllm_omni_kv.errors import KVPayloadError, KVTransferError

#: the longest legitimate sessions: NIXL's agent name at a 253-character host name, and
#: Mooncake's host:port
LONGEST_NIXL = f"omnikv-{'0' * 16}@{'h' * 253}:65535"
LONGEST_TE = f"{'h' * 253}:65535"


def test_the_longest_legitimate_sessions_fit() -> None:
    assert len(LONGEST_NIXL) == 283 <= MAX_SESSION
    assert is_session(LONGEST_NIXL) and is_session(LONGEST_TE)
    assert not is_session("") and not is_session(b"h:1") and not is_session(None)


def test_an_acquire_reply_with_an_over_long_session_is_refused() -> None:
    md: dict[str, Any] = {"data_size": 16, "src_addr": 4096, "session": "s" * MAX_SESSION}
    assert block_of(md) == (16, 4096)
    md["session"] = "s" * (MAX_SESSION + 1)
    with pytest.raises(PullFailed, match="not a session") as e:
        block_of(md)
    assert len(str(e.value)) < 300  # the message does not carry the session whole
    md["session"] = "s" * (1 << 20)
    with pytest.raises(PullFailed, match="not a session"):
        block_of(md)


class _Engine:
    session = "me:1"

    def __init__(self) -> None:
        self.forgot: list[str] = []

    def forget(self, session: str) -> None:
        self.forgot.append(session)


def _region() -> tuple[TECacheRegion, _Engine]:
    engine = _Engine()
    conn = SimpleNamespace(backend_name="nixl", engine=engine)
    return TECacheRegion(cast(PullTransferConnector, conn)), engine


def _desc(session: str, generation: int = 0) -> dict[str, Any]:
    return {"kind": "nixl", "session": session, "base": 4096, "size": 1 << 20,
            "generation": generation}  # fmt: skip


def test_a_payload_naming_an_over_long_session_is_refused() -> None:
    region, _engine = _region()
    assert region._remote(_desc(LONGEST_NIXL))[0] == LONGEST_NIXL
    for bad in ("s" * (MAX_SESSION + 1), "s" * (1 << 20), ""):
        with pytest.raises(KVPayloadError, match="bad region") as e:
            region._remote(_desc(bad))
        assert len(str(e.value)) < 400
    assert not region._seen


def test_the_generations_seen_are_bounded(monkeypatch: pytest.MonkeyPatch) -> None:
    assert cache_region.MAX_SEEN == 256
    monkeypatch.setattr(cache_region, "MAX_SEEN", 4)
    region, engine = _region()
    for i in range(50):  # producers that each slept once (generation 2)
        region._remote(_desc(f"omnikv-{i:016x}@127.0.0.1:{1000 + i}", 2))
        assert len(region._seen) <= 4
    assert len(engine.forgot) == 50  # each new generation reloads that peer
    # a remembered producer's older generation is still refused; a recent one is kept
    recent = "omnikv-0000000000000031@127.0.0.1:1049"
    assert recent in region._seen
    with pytest.raises(KVTransferError, match="generation 0"):
        region._remote(_desc(recent, 0))
    region._remote(_desc(recent, 2))
    assert len(engine.forgot) == 50  # same generation: nothing reloaded
