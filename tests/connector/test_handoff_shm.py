"""When a producer lets vLLM free the blocks of a one-copy send (:mod:`.handoff`), on a real
shared-memory backend with the cache in its region: only once vLLM finished the request
and the consumer released the hold; never while a consumer copies, unless it holds them
past the lease and its grace (a stopped reader process, whose copy then fails); after the
lease when nobody came; at once for an aborted request."""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import threading
import time
import uuid
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
import torch
from _pause import pause

from vllm_omni_kv.backends.shm import arena
from vllm_omni_kv.backends.shm.connector import SharedMemoryConnector
from vllm_omni_kv.connector.handoff import HandoffState, ProducerHandoffs
from vllm_omni_kv.connector.metadata import SaveSpec
from vllm_omni_kv.connector.page_export import PageExport
from vllm_omni_kv.connector.receive import LayerCache
from vllm_omni_kv.errors import KVTransferError
from vllm_omni_kv.kvcache.cache_layout import infer_identity
from vllm_omni_kv.transfer.session import TransferSession

BLOCKS, HEADS, BS, DIM, LAYERS = 64, 2, 32, 64, 2


class Producer:
    def __init__(self, ttl: float, grace: float = 30.0, timer: bool = False) -> None:
        self.ns = f"pytest-sends-{os.getpid()}-{uuid.uuid4().hex[:8]}"
        self.backend = SharedMemoryConnector({"namespace": self.ns, "share_cache": True})
        region = self.backend.cache_region
        assert region is not None
        per = BLOCKS * HEADS * BS * 2 * DIM * 4
        with region.allocation_context():
            buf = torch.zeros(LAYERS * per, dtype=torch.int8)
        views = [
            buf[i * per : (i + 1) * per].view(torch.float32).view(BLOCKS, HEADS, BS, 2 * DIM)
            for i in range(LAYERS)
        ]
        ident = infer_identity(views[0])
        self.layers = [LayerCache(f"l{i}", v, ident, None) for i, v in enumerate(views)]
        self.session = TransferSession(self.backend, "prefill", "decode")
        export = PageExport.create(region, self.layers, "shm")
        assert export is not None, "the cache was allocated in the region"
        self.export = export
        self.sends = ProducerHandoffs(self.session, ttl, grace=grace, timer=timer)

    def send(self, req: str) -> str:
        """Publish a one-copy payload for ``req``; return its hold."""
        hold = self.session.hold(req)
        spec = SaveSpec(req, req, [3, 4], 50, prompt_digest="d")
        data = self.export.payload(spec, self.layers, hold, {})
        _n, parts = self.session.publish(req, data)
        self.sends.published(req, req, hold=hold, parts=parts)
        return hold

    def close(self) -> None:
        self.sends.close()
        self.backend.close()
        left = arena.namespace_files(self.ns)
        assert not left, left


@pytest.fixture
def prod() -> Iterator[Producer]:
    p = Producer(ttl=0.5)
    yield p
    p.close()


def test_blocks_go_back_once_finished_and_released(prod: Producer) -> None:
    hold = prod.send("r1")
    assert prod.sends.done(set()) == set()  # vLLM has not finished it yet
    assert prod.sends.done({"r1"}) == set()  # finished, but the consumer has not copied
    prod.backend.cache_region.release(hold)  # what a consumer does after its copy
    assert prod.sends.done(set()) == {"r1"}
    assert len(prod.sends) == 0


def test_a_consumer_copying_keeps_the_blocks_past_the_lease(prod: Producer) -> None:
    hold = prod.send("r2")
    entered, leave = threading.Event(), threading.Event()
    reader = SharedMemoryConnector({"namespace": prod.ns, "share_cache": True})

    def copy() -> None:
        with reader.cache_region.reading(hold):  # type: ignore[union-attr]
            entered.set()
            leave.wait(10)

    t = threading.Thread(target=copy)
    t.start()
    try:
        assert entered.wait(5)
        time.sleep(0.7)  # past send_ttl
        prod.sends.check()  # the lease timer's tick
        assert prod.sends.state_of("r2") == [HandoffState.CLAIMED]
        assert prod.sends.done({"r2"}) == set(), "blocks freed under a reader"
    finally:
        leave.set()
        t.join(5)
        reader.close()
    assert prod.sends.done(set()) == {"r2"}


def test_nobody_comes_the_lease_runs_out(prod: Producer) -> None:
    hold = prod.send("r3")
    assert prod.sends.done({"r3"}) == set()
    time.sleep(0.6)
    prod.sends.check()  # the lease timer's tick
    assert prod.sends.state_of("r3") == [HandoffState.EXPIRED]
    assert prod.sends.expired == 1
    assert prod.sends.done(set()) == {"r3"}
    assert not os.path.exists(arena.path(hold))
    late = SharedMemoryConnector({"namespace": prod.ns, "share_cache": True})
    try:
        assert late.open_stream("prefill", "decode", "r3") is None  # descriptor withdrawn
    finally:
        late.close()


def test_an_aborted_request_frees_its_blocks_at_once(prod: Producer) -> None:
    hold = prod.send("r4")
    prod.sends.withdraw(["r4"])
    assert prod.sends.state_of("r4") == [HandoffState.WITHDRAWN]
    assert prod.sends.done({"r4"}) == {"r4"}
    assert not os.path.exists(arena.path(hold))


def test_a_waiting_consumer_extends_the_lease(prod: Producer) -> None:
    prod.send("r5")
    consumer = SharedMemoryConnector({"namespace": prod.ns, "share_cache": True})
    try:
        assert consumer.extend("prefill", "decode", "r5", 60.0)
        time.sleep(0.6)  # past send_ttl, within the extension
        prod.sends.check()
        assert prod.sends.state_of("r5") == [HandoffState.PUBLISHED]
        assert prod.sends.done({"r5"}) == set()
        stream: Any = consumer.open_stream("prefill", "decode", "r5")
        assert stream is not None
        hold = stream.obj["metadata"]["shared"]["hold"]
        with stream, consumer.cache_region.reading(hold):  # type: ignore[union-attr]
            pass
    finally:
        consumer.close()
    assert prod.sends.done(set()) == {"r5"}


def test_a_preemption_while_a_consumer_copies_fails_its_copy(prod: Producer) -> None:
    hold = prod.send("r6")
    entered, leave = threading.Event(), threading.Event()
    reader = SharedMemoryConnector({"namespace": prod.ns, "share_cache": True})
    errors: list[BaseException] = []

    def copy() -> None:
        try:
            with reader.cache_region.reading(hold):  # type: ignore[union-attr]
                entered.set()
                leave.wait(10)
        except BaseException as e:
            errors.append(e)

    t = threading.Thread(target=copy)
    t.start()
    try:
        assert entered.wait(5)
        prod.sends.revoke(["r6"])  # vLLM freed the blocks under the reader
        assert prod.sends.state_of("r6") == [HandoffState.WITHDRAWN]
    finally:
        leave.set()
        t.join(5)
        reader.close()
    assert len(errors) == 1 and isinstance(errors[0], KVTransferError), errors
    assert "preempted" in str(errors[0])
    assert prod.sends.done(set()) == set(), "a preempted request is not finished"


def test_a_copy_that_ends_before_a_preemption_is_good(prod: Producer) -> None:
    hold = prod.send("r7")
    reader = SharedMemoryConnector({"namespace": prod.ns, "share_cache": True})
    try:
        with reader.cache_region.reading(hold):  # type: ignore[union-attr]
            pass  # the copy ends (and its hold goes) before vLLM frees the blocks
        prod.sends.revoke(["r7"])  # must not make that finished copy fail
    finally:
        reader.close()
    assert not os.path.exists(arena.path(hold))
    assert prod.sends.state_of("r7") == [HandoffState.WITHDRAWN]


# -- a reader process stopped while it holds the blocks -------------------------------------
READER = """
import json, sys
from vllm_omni_kv.backends.shm.connector import SharedMemoryConnector
reader = SharedMemoryConnector({"namespace": sys.argv[1], "share_cache": True})
print("ready", flush=True)
key = sys.stdin.readline().strip()
stream = reader.open_stream("prefill", "decode", key)
shared = stream.obj["metadata"]["shared"]
try:
    with stream, reader.cache_region.reading(shared["hold"]):
        pages = reader.cache_region.attach(shared["region"])
        first = pages[: 1 << 16].clone()  # the copy has begun...
        print("copying", flush=True)
        sys.stdin.readline()
        rest = pages[1 << 16 : 1 << 17].clone()  # ...and ends once the process runs again
    print(json.dumps({"ok": True}), flush=True)
except Exception as e:
    print(json.dumps({"error": f"{type(e).__name__}: {e}"}), flush=True)
reader.close()
"""


def wait_until(pred: Any, timeout: float) -> bool:
    deadline = time.monotonic() + timeout
    while not pred():
        if time.monotonic() > deadline:
            return False
        time.sleep(0.02)
    return True


def test_a_stopped_reader_loses_the_blocks_after_the_lease_and_grace() -> None:
    ttl, grace = 1.0, 1.0
    prod = Producer(ttl, grace=grace, timer=True)
    env = {**os.environ, "PYTHONPATH": str(Path(__file__).resolve().parents[2])}
    child = subprocess.Popen(
        [sys.executable, "-c", READER, prod.ns],
        stdin=subprocess.PIPE,
        stdout=subprocess.PIPE,
        text=True,
        env=env,
    )
    assert child.stdin is not None and child.stdout is not None
    try:
        assert child.stdout.readline().strip() == "ready"
        hold = prod.send("r9")
        t0 = time.monotonic()
        assert prod.sends.done({"r9"}) == set()  # vLLM finished the request: blocks wait
        child.stdin.write("r9\n")
        child.stdin.flush()
        assert child.stdout.readline().strip() == "copying"
        pause(child.pid)  # the reader stops with the hold's lock taken
        time.sleep(max(0.0, t0 + ttl + 0.3 - time.monotonic()))  # past the lease
        assert prod.sends.state_of("r9") == [HandoffState.CLAIMED]
        assert prod.sends.done(set()) == set(), "blocks freed under a reader within its grace"
        assert wait_until(lambda: prod.sends.done(set()) == {"r9"}, ttl + grace + 5)
        freed_after = time.monotonic() - t0
        assert ttl + grace - 0.05 <= freed_after <= ttl + grace + 3, freed_after
        assert not os.path.exists(arena.path(hold))
        for layer in prod.layers:  # vLLM reuses the blocks for another request
            layer.cache.fill_(7.0)
        os.kill(child.pid, signal.SIGCONT)
        child.stdin.write("go\n")
        child.stdin.flush()
        result = json.loads(child.stdout.readline())
        assert "error" in result, "the resumed reader accepted pages that were taken back"
        assert "outlived the payload's lease" in result["error"], result
    finally:
        os.kill(child.pid, signal.SIGCONT)
        child.kill()
        child.wait(10)
        prod.close()
