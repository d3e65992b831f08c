"""What the connector's CUDA paths depend on, measured on the GPU this runs on.

    python scripts/gpu_probe.py --out RESULTS/gpu_probe.json      # `make gpu-check` runs it

Parts (each records what it found; ``ok`` says whether the connector's path held):

* ``host_register_twice``: a range registered through ``backends/host_pin.register`` is
  registered again through it (already pinned: no driver call); then a range registered by
  torch's bare ``cudaHostRegister`` wrapper is registered through ``host_pin.register`` (the
  driver refuses it with 712, ``cudaErrorHostMemoryAlreadyRegistered``) and through the bare
  wrapper, each followed by a kernel launch in the same thread (after ``host_pin`` the launch
  must not raise; after the bare wrapper: does the error stay pending?).
* ``staged_payload_vs_delayed_forward``: a forward that writes a request's pages is
  queued behind ``torch.cuda._sleep``; the payload is staged (``DeviceStager``) and packed
  at once: it must hold the forward's bytes, not the older ones.
* ``stale_write_race``: a write into the consumer's blocks is queued on the forward stream
  behind ``torch.cuda._sleep`` (last step's write into blocks freed and reallocated), then a
  load into those blocks runs through ``OmniKVWorker``: the load must land last.
* ``register_cost``: ``cudaHostRegister`` / unregister of 64 MiB, 1 GiB and 4 GiB of shared
  anonymous memory (what every shared-memory segment costs a CUDA process).
* ``registration_off_the_put_path``: a 1 GiB pooled shared-memory segment, as ``put``
  creates one, with its registration held back: ``acquire`` returns at once, a copy into it
  is exact, and the registration then lands on the pinner's thread (recorded calls).
* ``cuda_ipc``: a producer process exports a device buffer (``_share_cuda_``), this process
  opens it and reads it, the producer is killed (SIGKILL), and the buffer is read again and
  closed, with the device's free memory at each point. With two GPUs a consumer process on
  its own device (disjoint ``CUDA_VISIBLE_DEVICES``) opens it too; with one, that part is
  listed under ``skipped`` with the reason.

Exit status 2 without a CUDA device, 1 when a part failed, 0 otherwise.
"""

from __future__ import annotations

import argparse
import base64
import ctypes
import json
import mmap
import os
import select
import signal
import subprocess
import sys
import threading
import time
import traceback
import uuid
from collections.abc import Callable
from pathlib import Path
from types import SimpleNamespace
from typing import Any

import torch

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))
MIB = 2**20
#: GPU cycles ``torch.cuda._sleep`` spins to delay the forward stream (~0.2 s at ~2 GHz)
SLEEP_CYCLES = 400_000_000


def _host(nbytes: int) -> tuple[mmap.mmap, Any, int]:
    mm = mmap.mmap(-1, nbytes)
    anchor = ctypes.c_char.from_buffer(mm)
    return mm, anchor, ctypes.addressof(anchor)


def _launch() -> str | None:
    """Launch a kernel in this thread; None when it ran, else the error it raised."""
    try:
        x = torch.arange(1 << 16, device="cuda", dtype=torch.int64) * 2
        torch.cuda.synchronize()
        assert int(x.sum()) == (1 << 16) * ((1 << 16) - 1)
    except RuntimeError as e:
        return str(e).splitlines()[0]
    return None


def host_register_twice() -> dict[str, Any]:
    from vllm_omni_kv.backends.host_pin import clear_cuda_error, failure_message, register

    mm, anchor, ptr = _host(64 * MIB)
    cudart = torch.cuda.cudart()
    try:
        pin = register(ptr, len(mm))
        again = register(ptr, len(mm))  # ours already: "already pinned", no driver call
        own_twice = _launch()
        if again is not None:
            again.release()
        if pin is not None:
            pin.release()
        first = int(cudart.cudaHostRegister(ptr, len(mm), 1))  # someone else's registration
        refused = register(ptr, len(mm))  # the driver refuses (712); the error is cleared
        fixed = _launch()
        second = int(cudart.cudaHostRegister(ptr, len(mm), 1))
        bare = _launch()  # torch's wrapper alone: the refused call's error may be pending
        clear_cuda_error()
        cudart.cudaHostUnregister(ptr)
    finally:
        del anchor
        mm.close()
    already = again is not None and not again.owned
    return {
        "ok": pin is not None and already and refused is None and not (own_twice or fixed),
        "registered": pin is not None,
        "own_second_register_already_pinned": already,
        "foreign_registration_refused": refused is None,
        "refusal_message": failure_message("cudaHostRegister", second, len(mm)),
        "launch_after_refusal_through_host_pin": fixed or "ran",
        "bare_wrapper_codes": [first, second],
        "launch_after_refusal_through_bare_wrapper": bare or "ran",
    }


def _emulated(device: str, **kw: Any) -> tuple[Any, dict[str, torch.Tensor], Any]:
    from vllm_omni_kv.connector.engine_layout import EngineLayout
    from vllm_omni_kv.testing.layout_emulator import EmulatedEngine, build_caches

    e = EmulatedEngine(backend="FLASH_ATTN", layout="LBNHC", device=device, **kw)
    caches = build_caches(e)
    facts = EngineLayout(e.block_size, e.layout, e.backend, cache_dtype=e.cache_dtype)
    return e, caches, facts.identity(next(iter(caches.values())))


def staged_payload_vs_delayed_forward() -> dict[str, Any]:
    from vllm_omni_kv import KVCacheTransferData
    from vllm_omni_kv.kvcache.cache_layout import bits, page_view
    from vllm_omni_kv.kvcache.device_staging import DeviceStager
    from vllm_omni_kv.kvcache.paged_blocks import extract_request_blocks

    _e, caches, ident = _emulated("cuda", num_layers=4, num_blocks=64, kv_heads=8, head_size=128)
    ids, tokens = [5, 9, 2, 40], 4 * 32
    views = [page_view(c, ident) for c in caches.values()]
    g = torch.Generator(device="cuda").manual_seed(1)
    new = [
        torch.randint(
            -(2**15), 2**15 - 1, bits(v[ids]).shape, generator=g, device="cuda", dtype=torch.int16
        )
        for v in views
    ]
    idx = torch.tensor(ids, device="cuda")
    stager = DeviceStager(torch.device("cuda", 0))
    torch.cuda.synchronize()
    t0 = time.perf_counter()
    torch.cuda._sleep(SLEEP_CYCLES)  # the forward, late
    for v, n in zip(views, new, strict=True):
        bits(v).index_copy_(0, idx, n)
    data = extract_request_blocks(
        "r", ids, tokens, list(caches.values()), layout=ident, stager=stager
    )
    wire = KVCacheTransferData.from_bytes(data.to_bytes())
    packed_s = time.perf_counter() - t0
    got = wire["layer_blocks"]["kv_blocks"]
    same = all(torch.equal(bits(p), n.cpu()) for p, n in zip(got, new, strict=True))
    stager.close()
    return {"ok": same, "payload_holds_forward_bytes": same, "pack_seconds": round(packed_s, 3)}


def _worker(e: Any, ns: str) -> Any:
    from vllm_omni_kv.connector.config import parse_omni_kv_config
    from vllm_omni_kv.connector.engine_layout import EngineLayout
    from vllm_omni_kv.connector.worker import OmniKVWorker

    cfg = parse_omni_kv_config(
        {
            "backend": "fake",
            "backend_extra": {"namespace": ns},
            "recv_timeout": 10,
            "transfer_cpus": "inherit",
        }
    )
    vllm_config = SimpleNamespace(cache_config=SimpleNamespace(block_size=e.block_size))
    facts = EngineLayout(e.block_size, e.layout, e.backend, cache_dtype=e.cache_dtype)
    return OmniKVWorker(vllm_config, cfg, f"probe-{uuid.uuid4().hex[:6]}", engine=facts)


def stale_write_race() -> dict[str, Any]:
    from vllm_omni_kv.connector.metadata import LoadSpec, OmniKVConnectorMetadata, SaveSpec
    from vllm_omni_kv.testing import fake_backend
    from vllm_omni_kv.testing.layout_emulator import read_tokens, reference_tokens, write_tokens

    fake_backend.register_fake_backend()
    ns, seq, src_ids, dst_ids = f"probe{uuid.uuid4().hex[:8]}", 100, [7, 2, 9, 4], [1, 5, 0, 8]
    e, pc, _ident = _emulated("cuda")
    _e, cc, _ = _emulated("cuda")
    producer, consumer = _worker(e, ns), _worker(e, ns)
    try:
        producer.register_kv_caches(pc)
        consumer.register_kv_caches(cc)
        ref = reference_tokens(e, seq, seed=3)
        write_tokens(e, pc, src_ids, ref)
        producer.wait_for_save(
            OmniKVConnectorMetadata(saves=[SaveSpec("r", "t", src_ids, seq, "d")])
        )
        torch.cuda.synchronize()
        torch.cuda._sleep(SLEEP_CYCLES)  # last step's forward, still queued
        for c in cc.values():
            c.view(torch.uint8)[torch.tensor(dst_ids, device="cuda")] = 0xAB  # its stale write
        consumer.start_load_kv(
            OmniKVConnectorMetadata(loads=[LoadSpec("r", "t", dst_ids, 0, seq, seq, "d")])
        )
        done: set[str] = set()
        deadline = time.monotonic() + 30
        while "r" not in done and time.monotonic() < deadline:
            done |= consumer.get_transfer_results(set())[1]
            time.sleep(0.002)
        torch.cuda.synchronize()
        got = read_tokens(e, cc, dst_ids, seq)
        same = "r" in done and all(
            torch.equal(gk, rk) and gv is not None and rv is not None and torch.equal(gv, rv)
            for (rk, rv), (gk, gv) in zip(ref, got, strict=True)
        )
        producer.get_transfer_results({"r"})
    finally:
        consumer.shutdown()
        producer.shutdown()
        fake_backend.clear(ns)
    return {"ok": same, "load_finished": "r" in done, "load_landed_after_queued_write": same}


def register_cost() -> dict[str, Any]:
    from vllm_omni_kv.backends.host_pin import register

    rows = []
    for nbytes in (64 * MIB, 1024 * MIB, 4096 * MIB):
        mm, anchor, ptr = _host(nbytes)
        try:
            t0 = time.perf_counter()
            pin = register(ptr, nbytes)
            t1 = time.perf_counter()
            if pin is not None:
                pin.release()
            t2 = time.perf_counter()
        finally:
            del anchor
            mm.close()
        rows.append(
            {
                "mib": nbytes // MIB,
                "registered": pin is not None,
                "register_ms": round((t1 - t0) * 1e3, 2),
                "unregister_ms": round((t2 - t1) * 1e3, 2),
            }
        )
    return {"ok": all(r["registered"] for r in rows), "rows": rows}


def registration_off_the_put_path() -> dict[str, Any]:
    """A 1 GiB pooled segment (what ``put`` creates): ``acquire`` returns before its
    registration, which lands on the pinner's thread; a copy before it lands is exact."""
    from vllm_omni_kv.backends.host_pin import CudaPinOps
    from vllm_omni_kv.backends.pinner import Pinner, install_pinner
    from vllm_omni_kv.backends.shm import arena
    from vllm_omni_kv.backends.shm.pinned_map import PinnedMap
    from vllm_omni_kv.backends.shm.producer import ProducerArena
    from vllm_omni_kv.testing.pin_ops import RecordingPinOps

    gate = threading.Event()
    ops = RecordingPinOps(inner=CudaPinOps(), gate=gate)
    old = install_pinner(Pinner(ops))
    pa = ProducerArena(2 << 30, namespace=f"probe-pin-{os.getpid()}")
    try:
        t0 = time.perf_counter()
        seg, pooled = pa.acquire(1 << 30)
        acquire_s = time.perf_counter() - t0
        host = torch.frombuffer(arena.exported(seg.mm), dtype=torch.uint8)
        src = torch.randint(0, 256, (64 * MIB,), dtype=torch.uint8, device="cuda")
        host[: 64 * MIB].copy_(src)  # before the registration: pageable, synchronous
        early = bool(torch.equal(host[: 64 * MIB].cuda(), src)) and not host.is_pinned()
        gate.set()
        t1 = time.perf_counter()
        pin = seg.mm.pin if isinstance(seg.mm, PinnedMap) else None
        landed = pin is not None and pin.wait(120) and pin.pinned
        land_s = time.perf_counter() - t1
        late = landed and host.is_pinned()
        del host
        pa.release_unpublished(seg, pooled)
    finally:
        gate.set()
        pa.close()
        install_pinner(old)
    off_thread = all(c.thread != threading.get_ident() for c in ops.of("register"))
    clean = all(c.code == 0 and c.mapped for c in ops.calls)
    return {
        "ok": pooled and early and late and off_thread and clean,
        "acquire_ms": round(acquire_s * 1e3, 2),
        "registration_landed_ms_after_release": round(land_s * 1e3, 2),
        "copy_before_registration_exact": early,
        "pinned_after": late,
        "registered_off_the_calling_thread": off_thread,
        "calls": [[c.op, c.code, c.mapped] for c in ops.calls],
    }


def _free_mib(device: int = 0) -> float:
    return round(torch.cuda.mem_get_info(device)[0] / MIB, 1)


def _encode(shared: tuple[Any, ...]) -> list[Any]:
    return [
        {"b64": base64.b64encode(x).decode()} if isinstance(x, bytes) else x for x in shared[1:]
    ]


def _decode(fields: list[Any]) -> list[Any]:
    return [base64.b64decode(x["b64"]) if isinstance(x, dict) else x for x in fields]


def _producer(nbytes: int) -> None:
    """Child: export a filled device buffer, print its handle, wait to be killed."""
    buf = torch.randint(0, 256, (nbytes,), device="cuda", dtype=torch.uint8)
    torch.cuda.synchronize()
    shared = buf.untyped_storage()._share_cuda_()
    line = {"fields": _encode(shared), "sum": int(buf.sum(dtype=torch.int64))}
    print(json.dumps(line), flush=True)
    sys.stdin.read()


def _open_and_sum(fields: list[Any], device: int = 0) -> tuple[Any, int]:
    storage = torch.UntypedStorage._new_shared_cuda(device, *_decode(fields))
    view = torch.empty(0, dtype=torch.uint8, device=f"cuda:{device}")
    view.set_(storage, 0, (storage.nbytes(),), (1,))
    return view, int(view.sum(dtype=torch.int64))


def _consumer(fields_json: str) -> None:
    """Child on its own device: open the producer's buffer, print what happened."""
    try:
        _view, total = _open_and_sum(json.loads(fields_json))
        print(json.dumps({"sum": total}), flush=True)
    except Exception as e:  # noqa: BLE001 - the error is the finding
        print(json.dumps({"error": str(e).splitlines()[0]}), flush=True)


def _spawn(role: str, env: dict[str, str], arg: str = "") -> subprocess.Popen[str]:
    cmd = [sys.executable, __file__, "--role", role, *([arg] if arg else [])]
    return subprocess.Popen(
        cmd, stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True, env={**os.environ, **env}
    )


def _line(proc: subprocess.Popen[str], role: str, timeout: float = 90) -> dict[str, Any]:
    assert proc.stdout is not None
    if not select.select([proc.stdout], [], [], timeout)[0]:
        raise TimeoutError(f"the {role} process said nothing in {timeout:g}s")
    return json.loads(proc.stdout.readline())


def cuda_ipc(skipped: dict[str, str]) -> dict[str, Any]:
    nbytes, out = 256 * MIB, dict[str, Any]()
    producer = _spawn("producer", {"CUDA_VISIBLE_DEVICES": "0"}, str(nbytes))
    try:
        shared = _line(producer, "producer")
        free0 = _free_mib()
        view, total = _open_and_sum(shared["fields"])
        out.update(
            read_ok=total == shared["sum"], free_mib_before_open=free0, free_mib_open=_free_mib()
        )
        if torch.cuda.device_count() >= 2:
            other = _spawn("consumer", {"CUDA_VISIBLE_DEVICES": "1"}, json.dumps(shared["fields"]))
            res = _line(other, "consumer")
            other.wait(30)
            out["consumer_on_own_device"] = res.get("error") or (
                "same bytes" if res.get("sum") == shared["sum"] else "other bytes"
            )
        else:
            skipped["cuda_ipc.consumer_on_own_device"] = (
                f"needs 2 GPUs; this machine has {torch.cuda.device_count()}"
            )
        producer.send_signal(signal.SIGKILL)
        producer.wait(30)
        try:
            again = int(view.sum(dtype=torch.int64))
            torch.cuda.synchronize()
            out["read_after_producer_killed"] = (
                "same bytes" if again == shared["sum"] else "other bytes"
            )
        except RuntimeError as e:
            out["read_after_producer_killed"] = str(e).splitlines()[0]
        out["free_mib_after_kill"] = _free_mib()
        del view
        torch.cuda.synchronize()
        torch.cuda.empty_cache()
        out["free_mib_after_close"] = _free_mib()
    finally:
        if producer.poll() is None:
            producer.kill()
    return {"ok": bool(out.get("read_ok")), **out}


def _run(parts: dict[str, Callable[[], dict[str, Any]]]) -> dict[str, Any]:
    results = {}
    for name, fn in parts.items():
        t0 = time.perf_counter()
        try:
            results[name] = fn()
        except Exception as e:  # noqa: BLE001 - recorded as the part's failure
            results[name] = {
                "ok": False,
                "error": f"{type(e).__name__}: {e}",
                "trace": traceback.format_exc(limit=4),
            }
        results[name]["seconds"] = round(time.perf_counter() - t0, 2)
        print(f"gpu_probe: {name}: {'ok' if results[name]['ok'] else 'FAILED'}", flush=True)
    return results


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--out", type=Path, default=ROOT / "benchmarks" / "results" / "gpu_probe.json")
    ap.add_argument("--role", choices=["producer", "consumer"], help=argparse.SUPPRESS)
    ap.add_argument("arg", nargs="?", help=argparse.SUPPRESS)
    a = ap.parse_args(argv)
    if a.role == "producer":
        _producer(int(a.arg))
        return 0
    if a.role == "consumer":
        _consumer(a.arg)
        return 0
    if not torch.cuda.is_available():
        print(
            "gpu_probe: no CUDA device here (torch.cuda.is_available() is False)", file=sys.stderr
        )
        return 2
    torch.cuda.init()
    skipped: dict[str, str] = {}
    parts: dict[str, Callable[[], dict[str, Any]]] = {
        "host_register_twice": host_register_twice,
        "staged_payload_vs_delayed_forward": staged_payload_vs_delayed_forward,
        "stale_write_race": stale_write_race,
        "register_cost": register_cost,
        "registration_off_the_put_path": registration_off_the_put_path,
        "cuda_ipc": lambda: cuda_ipc(skipped),
    }
    results = _run(parts)
    report = {
        "device": torch.cuda.get_device_name(0),
        "devices": torch.cuda.device_count(),
        "torch": torch.__version__,
        "cuda": torch.version.cuda,
        "parts": results,
        "skipped": skipped,
        "ok": all(r["ok"] for r in results.values()),
    }
    a.out.parent.mkdir(parents=True, exist_ok=True)
    a.out.write_text(json.dumps(report, indent=2))
    print(json.dumps({k: v for k, v in report.items() if k != "parts"}, indent=2))
    return 0 if report["ok"] else 1


if __name__ == "__main__":
    raise SystemExit(main())
