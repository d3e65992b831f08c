"""Backend-conformance harnesses: one interface over every omni-connector backend.

A harness owns a producer side and a consumer side of one backend. For
``mooncake_te`` and ``nixl`` the producer lives in a separate process (``multiprocessing``
spawn) driven over a pipe whose messages are codec frames (no pickle of
payloads); the consumer is in the test process. Values that come back are
normalised (``ManagedBuffer`` -> tensor or bytes, then released) so the same
assertions hold for every backend.
"""

from __future__ import annotations

import contextlib
import ctypes
import importlib.util
import multiprocessing as mp
import os
import threading
import time
from collections.abc import Callable, Iterator
from multiprocessing.connection import Connection
from typing import Any

import pytest
import torch
import xxhash

from vllm_omni_kv.backends.base import OmniConnectorBase
from vllm_omni_kv.backends.pool import ManagedBuffer
from vllm_omni_kv.wire import codec
from vllm_omni_kv.wire.payload import KVCacheTransferData

FROM, TO = "0", "1"


def random_bytes_tensor(nbytes: int, seed: int) -> torch.Tensor:
    g = torch.Generator().manual_seed(seed)
    return torch.randint(0, 256, (nbytes,), dtype=torch.uint8, generator=g)


def checksum(t: torch.Tensor) -> int:
    return xxhash.xxh3_64_intdigest(t.contiguous().view(torch.uint8).numpy())


def normalize(value: Any) -> Any:
    """ManagedBuffer -> a private tensor (typed if the sender put a tensor) or bytes."""
    if isinstance(value, ManagedBuffer):
        with value:
            if value.dtype_name is not None:
                return value.to_tensor().clone()
            return bytes(value.tensor.numpy())
    return value


def wrap(obj: Any) -> Any:
    """KV payloads cross the test pipe as their dict, tagged for reconstruction."""
    if isinstance(obj, KVCacheTransferData):
        return {"__kv__": obj.to_dict()}
    return obj


def unwrap(obj: Any) -> Any:
    if isinstance(obj, dict) and set(obj) == {"__kv__"}:
        return KVCacheTransferData.from_dict(obj["__kv__"])
    return obj


class Harness:
    """Producer + consumer of one backend."""

    name = "base"
    #: keyword config for a throwaway connector (close / health tests)
    producer: Any
    consumer: OmniConnectorBase

    def put(self, key: str, obj: Any) -> tuple[bool, int, dict[str, Any] | None]:
        return self.producer.put(FROM, TO, key, obj)  # type: ignore[no-any-return]

    def put_random(self, key: str, nbytes: int, seed: int) -> tuple[dict[str, Any] | None, int]:
        t = random_bytes_tensor(nbytes, seed)
        ok, _size, meta = self.producer.put(FROM, TO, key, t)
        assert ok
        return meta, checksum(t)

    def get(self, key: str, meta: dict[str, Any] | None) -> Any:
        got = self.consumer.get(FROM, TO, key, meta)
        return None if got is None else normalize(got[0])

    def cleanup(self, key: str) -> None:
        self.producer.cleanup(key)

    def producer_health(self) -> dict[str, Any]:
        return self.producer.health()  # type: ignore[no-any-return]

    def fresh(self) -> OmniConnectorBase:
        raise NotImplementedError

    def close(self) -> None:
        self.producer.close()
        self.consumer.close()


class LocalHarness(Harness):
    def __init__(self, name: str, make: Callable[[], OmniConnectorBase]) -> None:
        self.name = name
        self._make = make
        self.producer = make()
        self.consumer = make()

    def fresh(self) -> OmniConnectorBase:
        return self._make()


# -- Mooncake TE: the producer in its own process ------------------------------------------


def _send(conn: Connection, obj: Any) -> None:
    conn.send_bytes(codec.encode(obj).to_bytearray())


def _recv(conn: Connection, timeout: float = 60.0) -> Any:
    if not conn.poll(timeout):
        raise TimeoutError(f"the sender process did not answer within {timeout:.0f}s")
    return codec.decode(bytearray(conn.recv_bytes()))


def sender_main(conn: Connection, config: dict[str, Any], backend: str = "mooncake_te") -> None:
    """Child process: a pull connector (``mooncake_te`` or ``nixl``) driven by commands on ``conn``."""
    os.environ.setdefault("MC_LOG_LEVEL", "ERROR")
    c: Any
    if backend == "nixl":
        from vllm_omni_kv.backends.nixl.connector import NixlPullConnector

        c = NixlPullConnector(config)
    else:
        from vllm_omni_kv.backends.pull.mooncake import MooncakeTransferEngineConnector

        c = MooncakeTransferEngineConnector(config)
    _send(conn, {"info": c.get_connection_info()})
    while True:
        try:
            msg = _recv(conn, timeout=600)
        except (EOFError, TimeoutError, OSError):
            break
        op = msg["op"]
        try:
            if op == "put":
                ok, size, meta = c.put(FROM, TO, msg["key"], unwrap(msg["data"]))
                _send(conn, {"ok": ok, "size": size, "meta": meta})
            elif op == "put_random":
                t = random_bytes_tensor(msg["nbytes"], msg["seed"])
                ok, size, meta = c.put(FROM, TO, msg["key"], t)
                _send(conn, {"ok": ok, "meta": meta, "checksum": checksum(t)})
            elif op == "cleanup":
                c.cleanup(msg["key"])
                _send(conn, {"ok": True})
            elif op == "health":
                _send(conn, {"health": c.health()})
            elif op == "hold_gil":  # a stuck process: no Python thread (side channel) runs
                _send(conn, {"ok": True})
                ctypes.PyDLL(None).usleep(int(msg["seconds"] * 1e6))  # PyDLL keeps the GIL
            elif op == "exit":
                break
        except Exception as e:
            _send(conn, {"error": f"{type(e).__name__}: {e}"})
    c.close()
    conn.close()


class SenderProcess:
    """A spawned process running a sender connector; ``call`` sends one command."""

    def __init__(self, config: dict[str, Any], backend: str = "mooncake_te") -> None:
        ctx = mp.get_context("spawn")
        self.conn, child = ctx.Pipe()
        self.proc = ctx.Process(target=sender_main, args=(child, config, backend), daemon=True)
        self.proc.start()
        child.close()
        self._lock = threading.Lock()
        try:
            self.info: dict[str, Any] = _recv(self.conn, 60)["info"]
        except BaseException:
            self.stop()
            raise

    def call(self, **msg: Any) -> dict[str, Any]:
        with self._lock:
            _send(self.conn, msg)
            reply: dict[str, Any] = _recv(self.conn)
        if "error" in reply:
            raise RuntimeError(f"sender process: {reply['error']}")
        return reply

    def stop(self, timeout: float = 10.0) -> None:
        if self.proc.is_alive():
            with contextlib.suppress(OSError, BrokenPipeError):
                _send(self.conn, {"op": "exit"})
            self.proc.join(timeout)
        if self.proc.is_alive():
            self.proc.kill()
            self.proc.join(timeout)
        self.conn.close()


class _RemoteProducer:
    def __init__(self, proc: SenderProcess) -> None:
        self.proc = proc

    def put(self, from_stage: str, to_stage: str, key: str, obj: Any) -> tuple[bool, int, Any]:
        r = self.proc.call(op="put", key=key, data=wrap(obj))
        return r["ok"], r["size"], r["meta"]

    def cleanup(self, key: str) -> None:
        self.proc.call(op="cleanup", key=key)

    def health(self) -> dict[str, Any]:
        return self.proc.call(op="health")["health"]  # type: ignore[no-any-return]

    def close(self) -> None:
        self.proc.stop()


def te_config(role: str, pool_mib: int = 320, **over: Any) -> dict[str, Any]:
    cfg: dict[str, Any] = {
        "role": role,
        "host": "127.0.0.1",
        "protocol": "tcp",
        "metadata_server": "P2PHANDSHAKE",
        "zmq_port": 0,
        "memory_pool_size": pool_mib << 20,
        "transfer_timeout_s": 20.0,
        "side_channel_timeout_s": 5.0,
    }
    cfg.update(over)
    return cfg


def nixl_config(role: str, pool_mib: int = 320, **over: Any) -> dict[str, Any]:
    cfg: dict[str, Any] = {
        "role": role,
        "host": "127.0.0.1",
        "zmq_port": 0,
        "memory_pool_size": pool_mib << 20,
        "transfer_timeout_s": 20.0,
        "side_channel_timeout_s": 5.0,
    }
    cfg.update(over)
    return cfg


def pull_backend(backend: str) -> tuple[Any, Callable[..., dict[str, Any]]]:
    """The connector class and config helper of pull backend ``backend``."""
    if backend == "nixl":
        from vllm_omni_kv.backends.nixl.connector import NixlPullConnector

        return NixlPullConnector, nixl_config
    from vllm_omni_kv.backends.pull.mooncake import MooncakeTransferEngineConnector

    return MooncakeTransferEngineConnector, te_config


#: the pull engines, as test parameters (marked, and skipped where not installed)
PULL_ENGINES = [
    pytest.param(
        "nixl",
        marks=[
            pytest.mark.nixl,
            pytest.mark.skipif(importlib.util.find_spec("nixl") is None, reason="no nixl"),
        ],
    ),
    pytest.param(
        "mooncake_te",
        marks=[
            pytest.mark.mooncake,
            pytest.mark.skipif(importlib.util.find_spec("mooncake") is None, reason="no mooncake"),
        ],
    ),
]


class PullHarness(Harness):
    """A pull backend (``mooncake_te``, ``nixl``): the sender connector in its own process,
    the receiver here. With ``register_cache`` on both sides (``<backend>_cache``) the
    consumer's (vLLM-like) KV cache is registered beside its pool: payloads still travel
    through the pools, and the cache's registration must not disturb them."""

    def __init__(self, backend: str, register_cache: bool = False) -> None:
        self.name = f"{backend}_cache" if register_cache else backend
        self._cls, self._config = pull_backend(backend)
        self._extra = {"register_cache": True} if register_cache else {}
        self.proc = SenderProcess(self._config("sender", **self._extra), backend=backend)
        self.producer = _RemoteProducer(self.proc)
        try:
            self.consumer = self._cls(self._config("receiver", **self._extra))
            self.consumer.update_sender_info(self.proc.info["host"], self.proc.info["zmq_port"])
            if register_cache:
                self.cache = self._registered_cache()
        except BaseException:
            self.proc.stop()
            raise

    def _registered_cache(self) -> torch.Tensor:
        region = self.consumer.cache_region
        assert region is not None
        ctx = region.allocation_context()
        assert ctx is not None
        with ctx:
            cache = torch.zeros(4 << 20, dtype=torch.int8)
        assert region.export([cache.view(torch.float32).view(128, 2, 32, 128)])
        return cache

    def put_random(self, key: str, nbytes: int, seed: int) -> tuple[dict[str, Any] | None, int]:
        r = self.proc.call(op="put_random", key=key, nbytes=nbytes, seed=seed)
        assert r["ok"]
        return r["meta"], r["checksum"]

    def fresh(self) -> OmniConnectorBase:
        return self._cls(self._config("dual", pool_mib=4, **self._extra))  # type: ignore[no-any-return]


class MooncakeStoreHarness(LocalHarness):
    def __init__(self, master: Any) -> None:
        from vllm_omni_kv.backends.mooncake_store.connector import MooncakeStoreConnector

        cfg = master.store_config(segment=320 << 20, localbuf=160 << 20)
        super().__init__("mooncake_store", lambda: MooncakeStoreConnector(cfg))


@contextlib.contextmanager
def make_harness(name: str) -> Iterator[Harness]:
    """Build the harness for ``name``; its processes/servers are always stopped."""
    if name == "shm":
        from vllm_omni_kv.backends.shm.connector import SharedMemoryConnector

        h: Harness = LocalHarness(
            "shm", lambda: SharedMemoryConnector({"namespace": f"conf{os.getpid()}"})
        )
        try:
            yield h
        finally:
            h.close()
    elif name in ("shm_share", "cuda_ipc"):  # payloads over shm, the cache exported
        from vllm_omni_kv.backends.factory import OmniConnectorFactory
        from vllm_omni_kv.backends.spec import ConnectorSpec

        extra = {"namespace": f"conf{os.getpid()}", "share_cache": True}
        spec = ConnectorSpec("shm" if name == "shm_share" else "cuda_ipc", extra)
        h = LocalHarness(name, lambda: OmniConnectorFactory.create_connector(spec))
        try:
            yield h
        finally:
            h.close()
    elif name in ("mooncake_te", "nixl", "mooncake_te_cache", "nixl_cache"):
        h = PullHarness(name.removesuffix("_cache"), register_cache=name.endswith("_cache"))
        try:
            yield h
        finally:
            h.close()
    elif name == "mooncake_store":
        from vllm_omni_kv.backends.mooncake_store.master import mooncake_master

        with mooncake_master() as m:
            h = MooncakeStoreHarness(m)
            try:
                yield h
            finally:
                h.close()
    else:
        raise ValueError(f"unknown backend harness {name!r}")


def wait_until(pred: Callable[[], bool], timeout: float, interval: float = 0.05) -> bool:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if pred():
            return True
        time.sleep(interval)
    return pred()
