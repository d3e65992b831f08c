"""Real engines with a shared secret: a consumer holding the producer's key (from
``auth_key_file``) loads its KV; one holding another key (from ``OMNIKV_AUTH_KEY_FILE``)
refuses every payload as not authenticated and recomputes. Each consumer's own local run is
the reference; the producer's shared-memory payloads are all released afterwards."""

from __future__ import annotations

import os
import struct
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
from pd_helpers import engine_cfg, engines, make_prompts, omni_ktc

from vllm_omni_kv.wire.auth import ENV_KEY_FILE

pytestmark = [pytest.mark.e2e, pytest.mark.slow]

PREFILL = {"do_remote_decode": True, "do_remote_prefill": False}


def _key(path: Path, secret: bytes) -> str:
    path.write_bytes(secret)
    path.chmod(0o600)
    return str(path)


@pytest.fixture(scope="module")
def pd(tiny_model_dir: Path, tmp_path_factory: pytest.TempPathFactory) -> Iterator[dict[str, Any]]:
    root = tmp_path_factory.mktemp("auth")
    key_a = _key(root / "a.key", os.urandom(48))
    key_b = _key(root / "b.key", os.urandom(48))
    prod = omni_ktc("kv_producer", backend="shm", auth_key_file=key_a)
    same = omni_ktc("kv_consumer", "recompute", backend="shm", recv_timeout=10, auth_key_file=key_a)
    other = omni_ktc("kv_consumer", "recompute", backend="shm", recv_timeout=10)
    with engines(
        ("auth-producer", engine_cfg(tiny_model_dir, prod)),
        ("auth-same-key", engine_cfg(tiny_model_dir, same, enable_prefix_caching=False)),
        (
            "auth-other-key",
            engine_cfg(
                tiny_model_dir, other, enable_prefix_caching=False, env={ENV_KEY_FILE: key_b}
            ),
        ),
    ) as (p, s, o):
        yield {"producer": p, "same": s, "other": o}


def _generate(engine: Any, prompts: list[list[int]], params: list[Any], n: int) -> dict:
    r = engine.generate(prompts, max_tokens=n, kv_transfer_params=params)
    assert "error" not in r, r
    return r


def _prefill(prod: Any, prompts: list[list[int]]) -> list[dict[str, Any]]:
    r = _generate(prod, prompts, [PREFILL] * len(prompts), 1)
    return [o["kv_transfer_params"] for o in r["outputs"]]


def _busy_producer_segments(prod: Any) -> list[str]:
    """The producer's shared-memory segments still holding a payload (not FREE)."""
    from vllm_omni_kv.backends.shm import arena as shm_arena

    busy = []
    for name in os.listdir(shm_arena.SHM_DIR):
        if not name.startswith(shm_arena.SEG_PREFIX):
            continue
        pid = shm_arena._owner_pid(name)
        try:
            if pid is None or os.getpgid(pid) != prod.proc.pid:
                continue
            with open(os.path.join(shm_arena.SHM_DIR, name), "rb") as f:
                if struct.unpack("<I", f.read(4))[0] != shm_arena.FREE:
                    busy.append(name)
        except (ProcessLookupError, FileNotFoundError):
            continue
    return busy


def test_same_key_loads_other_key_is_refused_and_recomputed(
    pd: dict[str, Any], tiny_model_dir: Path
) -> None:
    prompts = make_prompts(tiny_model_dir, 2, seed=31)
    local = {
        k: [o["token_ids"] for o in _generate(pd[k], prompts, [None] * 2, 12)["outputs"]]
        for k in ("same", "other")
    }
    assert local["same"] == local["other"]  # one model: the same colocated answer

    r = _generate(pd["same"], prompts, _prefill(pd["producer"], prompts), 12)
    for o, ids, want in zip(r["outputs"], prompts, local["same"], strict=True):
        load = o["kv_transfer_params"]["omni_kv_load"]
        assert load["ok"] is True and load["tokens"] == len(ids), load
        assert o["token_ids"] == want

    r = _generate(pd["other"], prompts, _prefill(pd["producer"], prompts), 12)
    for o, want in zip(r["outputs"], local["other"], strict=True):
        load = o["kv_transfer_params"]["omni_kv_load"]
        assert load["ok"] is False and "not authenticated" in load["error"], load
        assert "different auth keys" in load["error"], load
        assert o["token_ids"] == want  # recomputed locally
    log = "\n".join(pd["other"].log_lines)
    assert "not authenticated" in log

    deadline = time.monotonic() + 20
    while _busy_producer_segments(pd["producer"]) and time.monotonic() < deadline:
        time.sleep(0.2)
    assert not _busy_producer_segments(pd["producer"]), "a refused payload was never released"
