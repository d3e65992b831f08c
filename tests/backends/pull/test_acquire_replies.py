"""What a sender's ``acquire`` reply may carry into a receiver, and what it may not.

A reply names the block to pull (address, size, engine session, lease) and may carry
frame bytes: a small block whole (``frame``), a larger frame's head and digest trailer
(``head``, ``tail`` at ``tail_at``). A caller's metadata (``kv_transfer_params`` come
from clients) never carries frame bytes; a reply's frame bytes are verified by the frame's
own checksum as pulled bytes are; fields that do not name a block, a session, a lease or
bytes within the block fail the open before the receiver allocates anything, or (frame
bytes) are ignored. A hostile or broken sender is made by wrapping the real sender's
side-channel handler; both connectors are real (NIXL/UCX or Mooncake TCP on 127.0.0.1).
"""

from __future__ import annotations

import time
import uuid
from collections.abc import Iterator
from typing import Any

import pytest
import torch

from vllm_omni_kv.errors import KVPayloadError, KVTransferError
from vllm_omni_kv.wire import codec

from ..conformance import PULL_ENGINES, pull_backend

FROM, TO = "prefill", "decode"


class PullPair:
    """A sender and a receiver connector of one engine, in this process."""

    def __init__(self, engine: str) -> None:
        cls, config = pull_backend(engine)
        self.sender = cls(config("sender", pool_mib=16))
        self.receiver = cls(config("receiver", pool_mib=16))
        info = self.sender.get_connection_info()
        self.receiver.update_sender_info(info["host"], info["zmq_port"])

    @staticmethod
    def size_of(_key: str, data: dict[str, Any]) -> int:
        """Bytes a load of ``data``'s frame moves: all of them but the padding between
        its spans (the frame laid out by the codec, not by the connector)."""
        frame = bytes(codec.encode(data).to_bytearray())
        p = codec.read_prelude(frame, len(frame))
        spans = sum(v.numel() * v.element_size() for v in data.values())
        return p.data_start + p.trailer_len + spans

    def lie(self, monkeypatch: pytest.MonkeyPatch, change: Any) -> None:
        """Make the sender's ``acquire`` replies ``change(reply)``."""
        ops = self.sender._ops
        honest = ops._acquire
        monkeypatch.setattr(ops, "_acquire", lambda msg: change(honest(msg)))

    def close(self) -> None:
        self.receiver.close()
        self.sender.close()


def _pulled(pair: PullPair, key: str, metadata: dict[str, Any] | None = None) -> tuple[Any, int]:
    """``(obj, bytes moved)`` of a whole load of ``key`` (opened with ``metadata``)."""
    stream = pair.receiver.open_stream(FROM, TO, key, metadata)
    assert stream is not None
    with stream:
        for _ in stream.load(None, time.monotonic() + 20):
            pass
        return stream.obj, stream.moved


@pytest.fixture(scope="module", params=PULL_ENGINES)
def pair(request: pytest.FixtureRequest) -> Iterator[PullPair]:
    p = PullPair(request.param)
    try:
        yield p
    finally:
        p.close()


@pytest.mark.parametrize("kib", [4, 256])
def test_frame_bytes_in_the_callers_metadata_are_not_trusted(pair: PullPair, kib: int) -> None:
    """Only the sender's reply may carry frame bytes: a ``frame``, or a ``head`` and ``tail``,
    in the metadata a caller passes (``kv_transfer_params`` come from clients) are ignored
    and the frame pulled. The forgeries are a valid frame of the same size and shape."""
    n = kib * 256
    data = {"ids": torch.arange(n, dtype=torch.int32)}
    key = f"forged-{uuid.uuid4().hex[:8]}"
    _ok, size, meta = pair.sender.put(FROM, TO, key, data)
    assert meta is not None
    forged = bytes(codec.encode({"ids": torch.zeros(n, dtype=torch.int32)}).to_bytearray())
    assert len(forged) == size
    p = codec.read_prelude(forged, size)
    lies = {
        "frame": forged,
        "head": forged[: p.data_start],
        "tail_at": p.trailer_start,
        "tail": forged[p.trailer_start : p.total],
    }
    assert torch.equal(_pulled(pair, key, {**meta, **lies})[0]["ids"], data["ids"])


@pytest.mark.parametrize(
    "bad",
    [
        {"tail_at": -1},
        {"tail_at": 1 << 62},
        {"tail_at": 7.0},
        {"head": b"too short"},
        {"head": "str"},
        {"tail": None},
        {"head": bytes(512 << 10)},
    ],
    ids=[
        "tail_at<0",
        "tail_at>size",
        "tail_at float",
        "head<prelude",
        "head str",
        "no tail",
        "head>size",
    ],  # fmt: skip
)
def test_edges_a_reply_cannot_place_are_pulled(
    pair: PullPair, bad: dict[str, Any], monkeypatch: pytest.MonkeyPatch
) -> None:
    """Head or trailer fields of an ``acquire`` reply that do not name bytes within the
    block (wrong types, out of range, a head too short to hold a prelude or longer than the
    block) are ignored: the stream pulls all of the frame's bytes it loads."""
    data = {"kv": torch.randint(0, 1 << 30, (1 << 16,), dtype=torch.int32)}
    key = f"bad-edges-{uuid.uuid4().hex[:8]}"
    pair.sender.put(FROM, TO, key, data)
    pair.lie(monkeypatch, lambda reply: {**reply, **bad})
    got, moved = _pulled(pair, key)
    assert torch.equal(got["kv"], data["kv"])
    assert moved == pair.size_of(key, data)  # nothing came with the reply


@pytest.mark.parametrize("part", ["head", "tail"])
def test_a_reply_that_lies_about_a_frames_edges_fails_the_open(
    pair: PullPair, part: str, monkeypatch: pytest.MonkeyPatch
) -> None:
    """The head and trailer an ``acquire`` reply carries are verified by the frame's own
    checksum, as pulled bytes are: a reply with one of their bytes changed (a hostile or
    broken sender; made by wrapping the sender's ``acquire``) fails the open with
    ``KVPayloadError``, and the pull is released as failed, so the block stays for a
    retry, which gets the values put."""
    data = {"kv": torch.randint(0, 1 << 30, (1 << 16,), dtype=torch.int32)}
    key = f"lie-{uuid.uuid4().hex[:8]}"
    pair.sender.put(FROM, TO, key, data)

    def lying(reply: dict[str, Any]) -> dict[str, Any]:
        got = bytearray(reply[part])
        got[40 if part == "head" else 0] ^= 0x10
        return {**reply, part: bytes(got)}

    pair.lie(monkeypatch, lying)
    with pytest.raises(KVPayloadError):
        pair.receiver.open_stream(FROM, TO, key)
    monkeypatch.undo()
    assert torch.equal(_pulled(pair, key)[0]["kv"], data["kv"])


@pytest.mark.parametrize(
    "bad, match",
    [
        ({"lease": None}, "without a lease id"),
        ({"lease": 7}, "without a lease id"),
        ({"session": None}, "not a session"),
        ({"session": ""}, "not a session"),
        ({"session": ["127.0.0.1:1"]}, "not a session"),
        ({"data_size": -1}, "not a block"),
        ({"src_addr": (1 << 64) - 4096}, "past the end"),
    ],
    ids=[
        "no lease",
        "int lease",
        "no session",
        "empty session",
        "list session",
        "size<0",
        "address overflow",
    ],  # fmt: skip
)
def test_a_reply_that_names_no_block_fails_before_any_allocation(
    pair: PullPair, bad: dict[str, Any], match: str, monkeypatch: pytest.MonkeyPatch
) -> None:
    """A reply without a lease id, with an engine session that is not a non-empty string,
    or a block that is not one (a negative size, an end past the 64-bit address space)
    fails the open with a ``KVTransferError`` that says so, before the receiver allocates
    its receive block; the key is then served to an honest reply."""
    data = {"kv": torch.arange(1 << 16, dtype=torch.int32)}
    key = f"no-block-{uuid.uuid4().hex[:8]}"
    pair.sender.put(FROM, TO, key, data)
    used = pair.receiver.pool.allocator.used
    pair.lie(monkeypatch, lambda reply: {**reply, **bad})
    with pytest.raises(KVTransferError, match=match):
        pair.receiver.open_stream(FROM, TO, key)
    assert pair.receiver.pool.allocator.used == used
    monkeypatch.undo()
    got = pair.receiver.get(FROM, TO, key)
    assert got is not None and torch.equal(got[0]["kv"], data["kv"])


@pytest.mark.parametrize(
    "md",
    [
        {"source_host": "127.0.0.1", "source_port": "x"},
        {"source_host": "127.0.0.1", "source_port": [1]},
        {"sender_rank": "first"},
        {"from_rank": float("inf")},
    ],
    ids=["port str", "port list", "rank str", "rank inf"],
)
def test_a_callers_endpoint_that_is_not_a_number_is_a_transfer_error(
    pair: PullPair, md: dict[str, Any]
) -> None:
    """A port or sender rank in a caller's metadata that is not an integer fails the get
    with a ``KVTransferError`` naming the field."""
    with pytest.raises(KVTransferError, match="must be an integer"):
        pair.receiver.get(FROM, TO, "anything", md)
