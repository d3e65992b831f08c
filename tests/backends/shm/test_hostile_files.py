"""Files planted in ``/dev/shm`` under the name of a payload a consumer will claim: a
link to forged KV, a FIFO, a file of another user, a sparse giant. Each is refused at
once with ``KVPayloadError`` (the load fails and vLLM recomputes): nothing is followed,
nothing blocks, nothing is read whole."""

from __future__ import annotations

import os
import threading
from pathlib import Path
from typing import Any

import pytest
import torch

from vllm_omni_kv import KVCacheTransferData, SharedMemoryConnector
from vllm_omni_kv.backends.shm import arena
from vllm_omni_kv.backends.shm.connector import index_name
from vllm_omni_kv.errors import KVPayloadError, KVTransferError

NOBODY = 65534


#: the ``ns`` fixture (tests/backends/conftest.py) lets files be left: they are planted
NS_MAY_LEAVE_FILES = True


def _within(fn: Any, seconds: float = 10.0) -> Any:
    """``fn()`` on another thread; its result or error (a hang fails the test)."""
    got: list[Any] = []

    def run() -> None:
        try:
            got.append(fn())
        except BaseException as e:
            got.append(e)

    t = threading.Thread(target=run, daemon=True)
    t.start()
    t.join(seconds)
    assert not t.is_alive(), "blocked on a planted file"
    return got[0]


def _open_within(conn: SharedMemoryConnector, key: str, seconds: float = 10.0) -> BaseException:
    """``open_stream`` on another thread; the error it raised (a hang fails the test)."""
    got = _within(lambda: conn.open_stream("0", "1", key), seconds)
    assert isinstance(got, BaseException), f"planted file accepted: {got!r}"
    return got


def _plant(ns: str, key: str) -> Path:
    return Path(arena.path(index_name(ns, "0", "1", key)))


def test_a_link_to_a_real_payload_is_not_followed(ns: str, tmp_path: Path) -> None:
    with (
        SharedMemoryConnector({"namespace": ns}) as tx,
        SharedMemoryConnector({"namespace": ns}) as rx,
    ):
        kv = torch.arange(4096, dtype=torch.float32).reshape(1, 4096)
        tx.put("0", "1", "real", KVCacheTransferData("r", {"k": [kv]}, [0], {}))
        forged = tmp_path / "forged"
        forged.write_bytes(_plant(ns, "real").read_bytes())
        _plant(ns, "victim").symlink_to(forged)
        err = _open_within(rx, "victim")
        assert isinstance(err, KVPayloadError), err
        got = rx.get("0", "1", "real")  # the producer's own entry still loads
        assert got is not None


def test_a_fifo_does_not_block_the_load(ns: str) -> None:
    with SharedMemoryConnector({"namespace": ns}) as rx:
        os.mkfifo(_plant(ns, "fifo"), 0o600)
        assert isinstance(_open_within(rx, "fifo"), KVPayloadError)


def test_a_file_of_another_user_is_refused(ns: str) -> None:
    if os.geteuid() != 0:
        pytest.skip("needs root to plant a file owned by another user")
    with SharedMemoryConnector({"namespace": ns}) as rx:
        planted = _plant(ns, "other")
        planted.write_bytes(b"R" + b"\0" * 64)
        os.chown(planted, NOBODY, NOBODY)
        err = _open_within(rx, "other")
        assert isinstance(err, KVPayloadError) and "this user" in str(err), err


def test_a_sparse_giant_is_not_read(ns: str) -> None:
    with SharedMemoryConnector({"namespace": ns}) as rx:
        planted = _plant(ns, "giant")
        with open(planted, "wb") as f:
            f.truncate(1 << 30)  # 1 GiB, no pages behind it
        err = _open_within(rx, "giant")
        assert isinstance(err, KVPayloadError) and "bound" in str(err), err


@pytest.mark.parametrize("planted", ["fifo", "other user"])
def test_a_file_planted_under_a_released_hold_blocks_nobody(ns: str, planted: str) -> None:
    """A consumer released a hold; anyone may create a file under its name then (``/dev/shm``
    is world-writable). The producer takes the hold back, revokes or expires it, and a
    consumer that tries to read under it, without blocking or writing into that file."""
    if planted == "other user" and os.geteuid() != 0:
        pytest.skip("needs root to plant a file owned by another user")
    with SharedMemoryConnector({"namespace": ns, "share_cache": True}) as tx:
        region = tx.cache_region
        assert region is not None
        hold = region.hold("0", "1", "k")
        region.release(hold)  # what a consumer does after its copy
        path = Path(arena.path(hold))
        if planted == "fifo":
            os.mkfifo(path, 0o600)
        else:
            path.write_bytes(b"")
            os.chown(path, NOBODY, NOBODY)
        assert _within(lambda: region.revoke(hold)) is None
        assert path.stat().st_size == 0  # nothing appended
        err = _within(lambda: region.reading(hold).__enter__())
        assert isinstance(err, KVTransferError) and "took back" in str(err), err
        assert _within(lambda: region.take_back(hold)) is True
        assert _within(lambda: region.expire_hold(hold)) is True
