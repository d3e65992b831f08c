"""The WRITE direction's side-channel messages (engine-free): what a consumer builds parses
back to the same pages, and anything else a client may send is refused as
``KVTransferError`` before the producer acts on it."""

from __future__ import annotations

from typing import Any

import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from vllm_omni_kv.backends.nixl import write_wire as ww
from vllm_omni_kv.backends.pull.page_reads import PageReads, PageTable, group_ids
from vllm_omni_kv.errors import KVTransferError

SRC = (PageTable(1 << 20, 4096, 4096, 64), PageTable(1 << 24, 8192, 4096, 64))
DST = (PageTable(1 << 30, 4096, 4096, 32), PageTable(1 << 31, 4096, 4096, 32))
TOKEN = bytes(range(16))


def _reads(pairs: np.ndarray) -> PageReads:
    groups = ((np.arange(2, dtype=np.int64), pairs),)
    return PageReads(SRC, DST, *group_ids(SRC, DST, groups), len(pairs) * 2 * 4096, groups)


def test_a_move_parses_back_to_its_own_page_ids() -> None:
    rng = np.random.default_rng(0)
    pairs = np.stack([rng.permutation(64)[:32], rng.permutation(32)], 1).astype(np.int64)
    reads = _reads(pairs)
    name, tid, src, dst = ww.parse_tables(ww.tables_msg("consumer", reads))
    assert (name, src, dst) == ("consumer", SRC, DST)
    msgs = ww.page_write_msgs("consumer", reads, 5.0)
    assert len(msgs) == 1 and len({m["nonce"] for m in msgs}) == 1
    req = ww.parse_write(ww.with_token(msgs[0], TOKEN))
    assert req.pages is not None and req.pages.tables == tid and req.ttl_s == 5.0
    assert req.token == TOKEN and ww.token_of(ww.with_token(ww.abort_msg("c", TOKEN), TOKEN))
    s_ids, d_ids = ww.page_ids(req.pages, src, dst)
    assert s_ids.tolist() == reads.remote_ids.tolist()
    assert d_ids.tolist() == reads.local_ids.tolist()


def test_a_large_group_is_split_and_ranges_round_trip() -> None:
    big = (PageTable(0, 4096, 4096, 5000),)
    pairs = np.stack([np.arange(4000), np.arange(4000)], 1).astype(np.int64)
    groups = ((np.zeros(1, dtype=np.int64), pairs),)
    reads = PageReads(big, big, *group_ids(big, big, groups), 0, groups)
    msgs = ww.page_write_msgs("c", reads, 1.0)
    assert len(msgs) == -(-4000 // ww.MAX_PAIRS)
    got = [ww.parse_write(ww.with_token(m, TOKEN)) for m in msgs]
    assert sum(len(r.pages.pairs) for r in got if r.pages is not None) == 4000
    rows = [(4096 * i, 8192 * i + 1, 100 + i) for i in range(700)]
    msgs = ww.range_write_msgs("c", rows, 1.0)
    out = [ww.parse_write(ww.with_token(m, TOKEN)).ranges for m in msgs]
    assert [tuple(r) for part in out if part is not None for r in part.tolist()] == rows


@pytest.mark.parametrize("timeout_s", [0.5, ww.MAX_TTL_S, 3600.0])
def test_a_write_of_a_long_timeout_asks_for_the_longest_ttl_a_producer_takes(
    timeout_s: float,
) -> None:
    """A consumer's ``transfer_timeout_s`` above the producer's bound on a write's
    ``ttl_s`` (600 s) asks for that bound: its writes were refused as malformed."""
    msg = ww.with_token(ww.range_write_msgs("c", [(0, 0, 64)], timeout_s)[0], TOKEN)
    assert ww.parse_write(msg).ttl_s == min(timeout_s, ww.MAX_TTL_S)


def _valid_write() -> dict[str, Any]:
    msg = ww.page_write_msgs("c", _reads(np.array([[1, 2], [3, 4]], dtype=np.int64)), 1.0)[0]
    return ww.with_token(msg, TOKEN)


def _rows(*rows: tuple[int, int, int]) -> bytes:
    return np.array(rows, dtype="<u8").tobytes()


@pytest.mark.parametrize(
    "change",
    [
        {"ttl_s": float("nan")},
        {"ttl_s": 1e9},
        {"ttl_s": True},
        {"nonce": b"short"},
        {"token": None},
        {"token": b"short"},
        {"agent": ""},
        {"agent": "x\n"},
        {"groups": []},
        {"groups": [[b"\0\0\0\0"]]},
        {"groups": [[b"", b"\0" * 8]]},
        {"groups": [[b"\0\0\0\0", b"\0" * 7]]},
        {"tables": "not bytes"},
        {"ranges": b"\0" * 24},  # an empty range
        {"ranges": (np.array([[2**64 - 8, 0, 16]], dtype="<u8")).tobytes()},
        {"ranges": _rows((8192, 0, 4096), (4096, 0, 4097))},  # destinations overlap
        {"groups": [[np.array([0, 0], "<i4").tobytes(), np.array([1, 2], "<i4").tobytes()]]},
        {"groups": [[np.array([0], "<i4").tobytes(), np.array([1, 2, 3, 2], "<i4").tobytes()]]},
    ],
    ids=lambda c: next(iter(c)) + ("=" + repr(c[next(iter(c))])[:24]),
)
def test_malformed_writes_are_refused(change: dict[str, Any]) -> None:
    msg = {**_valid_write(), **change}
    if "ranges" in change:
        msg.pop("groups"), msg.pop("tables")
    with pytest.raises(KVTransferError):
        ww.parse_write(msg)


@pytest.mark.parametrize(
    "pairs", [[[64, 0]], [[0, 32]], [[-1, 0]]], ids=["src past", "dst past", "negative"]
)
def test_page_ids_past_their_tables_are_refused(pairs: list[list[int]]) -> None:
    msg = _valid_write()
    msg["groups"][0][1] = np.asarray(pairs, dtype="<i4").tobytes()
    with pytest.raises(KVTransferError):
        ww.page_ids(ww.parse_write(msg).pages, SRC, DST)  # type: ignore[arg-type]


def test_a_table_set_whose_id_is_not_its_digest_is_refused() -> None:
    msg = ww.tables_msg("c", _reads(np.array([[0, 0]], dtype=np.int64)))
    with pytest.raises(KVTransferError):
        ww.parse_tables({**msg, "id": bytes(16)})
    overlapping = np.array([[0, 10, 4096, 2]], dtype="<u8").tobytes()
    with pytest.raises(KVTransferError):
        ww.parse_tables({**msg, "src": overlapping, "dst": overlapping})


_ANY = st.recursive(
    st.none()
    | st.booleans()
    | st.integers()
    | st.floats()
    | st.binary(max_size=64)
    | st.text(max_size=8),
    lambda inner: st.lists(inner, max_size=4),
    max_leaves=12,
)


@settings(max_examples=300, deadline=None)
@given(
    st.dictionaries(
        st.sampled_from(
            [
                "agent",
                "token",
                "nonce",
                "ttl_s",
                "tables",
                "groups",
                "ranges",
                "md",
                "spans",
                "proof",
                "id",
                "src",
                "dst",
            ]
        ),
        _ANY,
    )
)
def test_any_message_parses_or_is_a_transfer_error(msg: dict[str, Any]) -> None:
    for parse in (ww.parse_write, ww.parse_tables, ww.parse_sink, ww.parse_proof):
        try:
            parse(msg)
        except KVTransferError:
            pass


def test_page_indices_past_int32_are_refused() -> None:
    """Writes are posted by int32 index into the concatenated tables: a checked index past
    2**31 - 1 would wrap to another page."""
    big = PageTable(0, 4096, 4096, 2**31 - 1)
    msg = _valid_write()
    msg["groups"][0] = [np.array([1], "<i4").tobytes(), np.array([5, 5], "<i4").tobytes()]
    req = ww.parse_write(msg)
    assert req.pages is not None
    with pytest.raises(KVTransferError, match="int32"):
        ww.page_ids(req.pages, (big, big), (big, big))
    ok = ww.page_ids(req.pages, (SRC[0], big), (DST[0], big))
    assert ok[0].tolist() == [64 + 5]
