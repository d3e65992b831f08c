"""Helpers for the end-to-end connector tests: prompts, engine configs, process cleanup."""

from __future__ import annotations

import contextlib
import os
import signal
import time
import uuid
from collections.abc import Iterator
from pathlib import Path
from typing import Any

from vllm_omni_kv.testing.engine_proc import EngineProc, kill_group
from vllm_omni_kv.tiny_model import prompt_text

__all__ = [
    "IN_PROCESS",
    "LOG_DIR",
    "NAMESPACE",
    "PRELOAD",
    "SERVE_NAMESPACE",
    "SMALL_CACHE_BLOCKS",
    "EngineProc",
    "assert_abort_while_loading_frees_every_block",
    "assert_cache_free",
    "colocated_reference",
    "engine_cfg",
    "engines",
    "kill_group",
    "live_arena_segment",
    "long_prompt",
    "make_prompts",
    "omni_ktc",
    "omnikv_files",
    "sweep_dead_segments",
    "tcp_connected",
    "whole_cache_prompt",
]

LOG_DIR = Path(os.environ.get("OMNIKV_TEST_LOGS", "/tmp/omnikv-test-logs"))
#: the shared-memory namespace of this test run's engines: leak checks look only at its
#: files, so another run (or a benchmark) on the same host cannot fail them
NAMESPACE = f"pytest-{os.getpid()}-{uuid.uuid4().hex[:8]}"
#: the namespace of the session's ``vllm serve`` deployment (conftest ``example_pd``): it
#: lives across modules, so its files stay out of the other modules' checks
SERVE_NAMESPACE = f"{NAMESPACE}-serve"
#: TP-1 test engines run in one process; ``OMNIKV_TEST_IN_PROCESS=0`` gives them vLLM's
#: engine-core and worker processes instead
IN_PROCESS = os.environ.get("OMNIKV_TEST_IN_PROCESS", "1") != "0"
#: in-process engines fork from a preloaded interpreter per test process (torch and vLLM
#: imported once: ``engine_zygote``); ``OMNIKV_TEST_PRELOAD=0`` starts each one fresh
PRELOAD = os.environ.get("OMNIKV_TEST_PRELOAD", "1") != "0"


def make_prompts(model_dir: Path, n: int, seed: int = 0) -> list[list[int]]:
    """``n`` token-id prompts of a few hundred tokens, lengths not multiples of 32."""
    from transformers import AutoTokenizer

    tok = AutoTokenizer.from_pretrained(str(model_dir))
    out = []
    for i in range(n):
        ids = tok(prompt_text(seed * 1000 + i, 170 + 45 * i))["input_ids"]
        if len(ids) % 32 == 0:
            ids = ids[:-1]
        out.append(list(ids))
    return out


SHM_BACKENDS = ("shm", "shared_memory", "SharedMemoryConnector", "cuda_ipc")


def omni_ktc(role: str, policy: str | None = None, **extra: Any) -> dict[str, Any]:
    """A ``KVTransferConfig`` mapping for :class:`OmniKVConnector` (in this run's namespace)."""
    if extra.get("backend", "shm") in SHM_BACKENDS:  # the one setting shared memory takes
        extra["backend_extra"] = {"namespace": NAMESPACE, **extra.get("backend_extra", {})}
    ktc: dict[str, Any] = {
        "kv_connector": "OmniKVConnector",
        "kv_role": role,
        "kv_connector_extra_config": extra,
    }
    if policy is not None:
        ktc["kv_load_failure_policy"] = policy
    return ktc


def engine_cfg(model_dir: Path, ktc: dict[str, Any] | None = None, **kw: Any) -> dict[str, Any]:
    """An :class:`EngineProc` config; a TP-1 engine runs in one process (``in_process``:
    a start takes about a third of the time; the ``vllm serve`` tests and TP > 1 engines
    keep vLLM's engine-core and worker processes)."""
    inproc = kw.get("tensor_parallel_size", 1) == 1 and IN_PROCESS
    cfg: dict[str, Any] = {"model": str(model_dir), "in_process": inproc, **kw}
    if ktc is not None:
        cfg["kv_transfer_config"] = ktc
    return cfg


@contextlib.contextmanager
def engines(*cfgs: tuple[str, dict[str, Any]]) -> Iterator[list[EngineProc]]:
    """Start engines concurrently; always stop them, also when a test fails."""
    LOG_DIR.mkdir(parents=True, exist_ok=True)
    procs: list[EngineProc] = []
    before = omnikv_files()
    try:
        for name, cfg in cfgs:
            log = LOG_DIR / f"{name}.log"
            log.unlink(missing_ok=True)
            cfg = dict(cfg)
            env = cfg.pop("env", None)  # per-engine environment (e.g. CPU thread binding)
            procs.append(EngineProc(cfg, env=env, log=log, preloaded=PRELOAD))
        for p in procs:
            p.wait_ready()
        yield procs
    finally:
        for p in procs:
            p.request_stop()
        for p in procs:
            p.stop()
        killed = any(p.proc.returncode == -signal.SIGKILL for p in procs)
        left = {n for n in omnikv_files() - before if not _owned_by_live_process(n)}
        sweep_dead_segments()
    if not killed:  # a SIGKILLed producer cannot clean up: sweep_dead_segments did
        assert not left, f"engines left shared-memory files behind after shutdown: {sorted(left)}"


def sweep_dead_segments(wait_s: float = 0.0) -> None:
    """Unlink shared-memory files left by engines this test killed. ``wait_s``: first wait
    (up to that long) for the owners of this run's segments to exit (a killed engine's
    worker processes may outlive its main process for a moment)."""
    deadline = time.monotonic() + wait_s
    while time.monotonic() < deadline and any(live_arena_segment(n) for n in omnikv_files()):
        time.sleep(0.1)
    with contextlib.suppress(Exception):
        from vllm_omni_kv.backends.shm import arena as shm_arena

        shm_arena.sweep_orphans()


def omnikv_files(namespace: str = NAMESPACE) -> set[str]:
    """This run's shared-memory files (see :data:`NAMESPACE`)."""
    from vllm_omni_kv.backends.shm import arena as shm_arena

    return shm_arena.namespace_files(namespace)


def _owned_by_live_process(name: str) -> bool:
    """Files of processes still running (other users of this host) are not ours to judge."""
    from vllm_omni_kv.backends.shm import arena as shm_arena

    pid = shm_arena._owner_pid(name)
    return pid is not None and shm_arena.pid_alive(pid)


def live_arena_segment(name: str) -> bool:
    """An arena segment of a live producer: it outlives single requests by design."""
    from vllm_omni_kv.backends.shm import arena as shm_arena

    if not name.startswith(shm_arena.SEG_PREFIX):
        return False
    pid = shm_arena._owner_pid(name)
    return pid is not None and shm_arena.pid_alive(pid)


#: a KV cache of this many 32-token blocks (``num_gpu_blocks_override``; vLLM keeps one as
#: its null block): one prompt of :func:`whole_cache_prompt` needs every other block, so it
#: completes only when no block leaked
SMALL_CACHE_BLOCKS = 65


def long_prompt(model_dir: Path, n_tokens: int, seed: int = 0) -> list[int]:
    """A token-id prompt of exactly ``n_tokens`` tokens."""
    from transformers import AutoTokenizer

    tok = AutoTokenizer.from_pretrained(str(model_dir))
    ids: list[int] = []
    part = 0
    while len(ids) < n_tokens:
        ids += tok(prompt_text(seed * 1000 + part, 400))["input_ids"]
        part += 1
    return ids[:n_tokens]


def whole_cache_prompt(model_dir: Path, max_tokens: int = 4) -> list[int]:
    """A prompt that, with ``max_tokens`` generated, fills all :data:`SMALL_CACHE_BLOCKS`."""
    return long_prompt(model_dir, (SMALL_CACHE_BLOCKS - 1) * 32 - max_tokens, seed=99)


def assert_cache_free(engine: EngineProc, model_dir: Path, timeout: float = 120.0) -> None:
    """Every KV block of ``engine`` (started with ``num_gpu_blocks_override`` =
    :data:`SMALL_CACHE_BLOCKS`) is free: a request needing all of them completes. A block
    held by a request that never finished (a leaked producer payload) keeps it waiting."""
    try:
        r = engine.generate([whole_cache_prompt(model_dir)], max_tokens=4, timeout=timeout)
    except TimeoutError:
        raise AssertionError(
            "a request needing the whole KV cache did not run: blocks are still held"
        ) from None
    assert "error" not in r and len(r["outputs"][0]["token_ids"]) == 4, r


def colocated_reference(
    model_dir: Path, prompts: list[list[int]], max_tokens: int = 16, name: str = "colocated"
) -> dict[tuple[int, ...], list[int]]:
    """Greedy tokens of ``prompts`` from a colocated engine (no connector) of the model."""
    with engines((name, engine_cfg(model_dir))) as (colo,):
        out = colo.generate(prompts, max_tokens=max_tokens)
    assert "error" not in out, out
    return {tuple(p): o["token_ids"] for p, o in zip(prompts, out["outputs"])}


def tcp_connected(port: int) -> bool:
    """Some process on this host holds an established loopback TCP connection to ``port``."""
    for table in ("/proc/net/tcp", "/proc/net/tcp6"):
        try:
            with open(table) as f:
                rows = f.read().splitlines()[1:]
        except OSError:
            continue
        for row in rows:
            cols = row.split()
            if len(cols) > 3 and cols[3] == "01" and int(cols[2].rsplit(":", 1)[1], 16) == port:
                return True
    return False


#: what the proxy sends a producer: prefill only, keep the KV for a remote decode
REMOTE_DECODE = {"do_remote_decode": True, "do_remote_prefill": False}
PullPD = tuple[
    EngineProc, EngineProc, dict[tuple[int, ...], list[int]], list[list[int]], list[list[int]]
]


@contextlib.contextmanager
def pull_pd(
    model_dir: Path,
    name: str,
    prod_ktc: dict[str, Any],
    cons_ktc: dict[str, Any],
    seed: int,
) -> Iterator[PullPD]:
    """A producer and a consumer engine of a pull backend, the producer's own greedy tokens
    as the reference, and two prompt groups: ``equal`` (loaded) and ``killed``."""
    equal = make_prompts(model_dir, 3, seed=seed)
    killed = make_prompts(model_dir, 2, seed=seed + 1)
    with engines(
        (f"{name}-producer", engine_cfg(model_dir, prod_ktc)),
        (f"{name}-consumer", engine_cfg(model_dir, cons_ktc)),
    ) as (prod, cons):
        # reference: the producer as an ordinary engine (no transfer params)
        out = prod.generate(equal + killed, max_tokens=16)
        ref = {tuple(p): o["token_ids"] for p, o in zip(equal + killed, out["outputs"])}
        yield prod, cons, ref, equal, killed


def prefill_remote(prod: EngineProc, prompts: list[list[int]]) -> list[dict[str, Any]]:
    """Prefill ``prompts`` for a remote decode; the kv_transfer_params the producer returns."""
    r = prod.generate(prompts, max_tokens=1, kv_transfer_params=[REMOTE_DECODE] * len(prompts))
    assert "error" not in r, r
    params = [o["kv_transfer_params"] for o in r["outputs"]]
    assert all(p["remote_port"] > 0 for p in params), params
    return params


def assert_pull_loads_equal(pd: PullPD) -> None:
    """The consumer loads every prompt of ``equal`` and decodes the reference's tokens."""
    prod, cons, ref, equal, _ = pd
    r = cons.generate(equal, max_tokens=16, kv_transfer_params=prefill_remote(prod, equal))
    assert "error" not in r, r
    for o, ids in zip(r["outputs"], equal):
        assert o["token_ids"] == ref[tuple(ids)]
        load = o["kv_transfer_params"]["omni_kv_load"]
        # the reference run cached these prompts' blocks on the producer, not the consumer
        assert load["ok"] is True and load["tokens"] == len(ids) and load["bytes"] > 0, load


def assert_killed_producer_recomputes(pd: PullPD, recv_timeout: float) -> None:
    """Kill the producer after its prefills: the consumer's loads fail within bounds and
    it recomputes the reference's tokens."""
    prod, cons, ref, _, killed = pd
    params = prefill_remote(prod, killed)
    kill_group(prod.proc.pid)
    prod.proc.wait(timeout=30)
    t0 = time.monotonic()
    r = cons.generate(killed, max_tokens=16, kv_transfer_params=params)
    assert time.monotonic() - t0 < recv_timeout + 15
    assert "error" not in r, r
    for o, ids in zip(r["outputs"], killed):
        assert o["token_ids"] == ref[tuple(ids)]
        load = o["kv_transfer_params"]["omni_kv_load"]
        assert load["ok"] is False and load["error"], load


def assert_abort_while_loading_frees_every_block(
    cons: EngineProc, prompt: list[int], params: dict[str, Any]
) -> None:
    """The consumer's request waits for a payload that is never published (``params`` of a
    real prefill under a fresh ``remote_request_id``); vLLM aborts it as a client hang-up
    does: every block the request held goes back to the pool at once (a load that was not
    cancelled would keep them until ``recv_timeout``, 30 s)."""
    never = {**params, "remote_request_id": f"never-published-{time.time_ns()}"}
    out = cons.abort_while_loading(prompt, never)
    assert "error" not in out, out
    assert out["free_while_waiting"] is not None, out  # it did wait for its remote KV
    assert out["free_while_waiting"] < out["free_before"], out  # ... holding blocks
    assert out["requests_left"] == 0 and out["free_after"] == out["free_before"], out
    assert out["seconds_to_free"] < 5, out
