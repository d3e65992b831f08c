"""Real engines: which payloads a consumer accepts. One producer (a shared secret from
``auth_key_file``) and three consumers, each computing its own local reference (prefix
caching off, so a local run leaves nothing cached):

- ``same``: the producer's key and the same weights loaded from another path: it loads
  the producer's KV, and computes locally a request whose kv_transfer_params name a
  producer it does not trust;
- ``other_key``: the same weights, another key (from ``OMNIKV_AUTH_KEY_FILE``): it refuses
  every payload as not authenticated and recomputes; the producer's shared-memory payloads
  are all released afterwards;
- ``other_weights``: the producer's key, other weights (same architecture and tokenizer):
  it refuses the KV and recomputes.

Hostile ``kv_transfer_params`` (non-finite numbers, strings, nested objects, a producer
TP size of 10^7) sent to ``same`` each cost one locally computed request, no memory,
and leave the engine serving.
"""

from __future__ import annotations

import math
import os
import shutil
import struct
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
from pd_helpers import engine_cfg, engines, make_prompts, omni_ktc

from vllm_omni_kv.tiny_model import TinyModelSpec, _write_weights
from vllm_omni_kv.wire.auth import ENV_KEY_FILE

pytestmark = [pytest.mark.e2e, pytest.mark.slow]

PREFILL = {"do_remote_decode": True, "do_remote_prefill": False}


def _key(path: Path, secret: bytes) -> str:
    path.write_bytes(secret)
    path.chmod(0o600)
    return str(path)


@pytest.fixture(scope="module")
def models(tiny_model_dir: Path, tmp_path_factory: pytest.TempPathFactory) -> dict[str, Path]:
    root = tmp_path_factory.mktemp("compat")
    same = root / "same-weights-other-path"
    shutil.copytree(tiny_model_dir, same)
    other = root / "other-weights"
    shutil.copytree(tiny_model_dir, other)
    (other / "model.safetensors").unlink()
    _write_weights(other, TinyModelSpec(seed=7))
    return {"producer": tiny_model_dir, "same": same, "other_weights": other}


@pytest.fixture(scope="module")
def pd(
    models: dict[str, Path], tmp_path_factory: pytest.TempPathFactory
) -> Iterator[dict[str, Any]]:
    root = tmp_path_factory.mktemp("auth")
    key_a = _key(root / "a.key", os.urandom(48))
    key_b = _key(root / "b.key", os.urandom(48))
    prod = omni_ktc("kv_producer", backend="shm", auth_key_file=key_a)
    keyed = omni_ktc(
        "kv_consumer", "recompute", backend="shm", recv_timeout=10, auth_key_file=key_a
    )
    unkeyed = omni_ktc("kv_consumer", "recompute", backend="shm", recv_timeout=10)
    local = {"enable_prefix_caching": False}
    with engines(
        ("accept-producer", engine_cfg(models["producer"], prod)),
        ("accept-same", engine_cfg(models["same"], keyed, **local)),
        (
            "accept-other-key",
            engine_cfg(models["producer"], unkeyed, env={ENV_KEY_FILE: key_b}, **local),
        ),
        ("accept-other-weights", engine_cfg(models["other_weights"], keyed, **local)),
    ) as (p, s, ok, ow):
        yield {"producer": p, "same": s, "other_key": ok, "other_weights": ow}


def _generate(engine: Any, prompts: list[list[int]], params: list[Any], n: int = 12) -> dict:
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
        for k in ("same", "other_key")
    }
    assert local["same"] == local["other_key"]  # one model: the same colocated answer

    r = _generate(pd["same"], prompts, _prefill(pd["producer"], prompts), 12)
    for o, ids, want in zip(r["outputs"], prompts, local["same"], strict=True):
        load = o["kv_transfer_params"]["omni_kv_load"]
        assert load["ok"] is True and load["tokens"] == len(ids), load
        assert o["token_ids"] == want

    r = _generate(pd["other_key"], prompts, _prefill(pd["producer"], prompts), 12)
    for o, want in zip(r["outputs"], local["other_key"], strict=True):
        load = o["kv_transfer_params"]["omni_kv_load"]
        assert load["ok"] is False and "not authenticated" in load["error"], load
        assert "different auth keys" in load["error"], load
        assert o["token_ids"] == want  # recomputed locally
    log = "\n".join(pd["other_key"].log_lines)
    assert "not authenticated" in log

    deadline = time.monotonic() + 20
    while _busy_producer_segments(pd["producer"]) and time.monotonic() < deadline:
        time.sleep(0.2)
    assert not _busy_producer_segments(pd["producer"]), "a refused payload was never released"


def test_compat_other_weights_refused_same_weights_accepted(
    pd: dict[str, Any], models: dict[str, Path]
) -> None:
    prompts = make_prompts(models["producer"], 2, seed=11)
    local = {
        k: [o["token_ids"] for o in _generate(pd[k], prompts, [None] * 2)["outputs"]]
        for k in ("same", "other_weights")
    }
    assert local["same"] != local["other_weights"], "the two models must answer differently"

    r = _generate(pd["same"], prompts, _prefill(pd["producer"], prompts))
    for o, want in zip(r["outputs"], local["same"], strict=True):
        load = o["kv_transfer_params"]["omni_kv_load"]
        assert load["ok"] is True, load
        assert o["token_ids"] == want

    r = _generate(pd["other_weights"], prompts, _prefill(pd["producer"], prompts))
    for o, want in zip(r["outputs"], local["other_weights"], strict=True):
        load = o["kv_transfer_params"]["omni_kv_load"]
        assert load["ok"] is False and "weights" in load["error"], load
        assert o["token_ids"] == want  # recomputed with its own weights


def test_untrusted_producer_in_kv_transfer_params_is_computed_locally(
    pd: dict[str, Any], models: dict[str, Path]
) -> None:
    prompts = make_prompts(models["producer"], 1, seed=12)
    want = _generate(pd["same"], prompts, [None])["outputs"][0]["token_ids"]
    params = _prefill(pd["producer"], prompts)
    forged = [{**params[0], "remote_host": "203.0.113.9"}]  # a client's own endpoint
    r = _generate(pd["same"], prompts, forged)
    out = r["outputs"][0]
    assert out["token_ids"] == want
    assert not (out.get("kv_transfer_params") or {}).get("omni_kv_load")  # nothing loaded
    assert "not in kv_connector_extra_config.trusted_producers" in "\n".join(pd["same"].log_lines)
    # the producer still holds the payload: the genuine params load it
    r = _generate(pd["same"], prompts, params)
    assert r["outputs"][0]["kv_transfer_params"]["omni_kv_load"]["ok"] is True
    assert r["outputs"][0]["token_ids"] == want


def _rss_kib(pgid: int) -> int:
    """Resident memory of every process of an engine's process group (KiB)."""
    total = 0
    for pid in filter(str.isdigit, os.listdir("/proc")):
        try:
            with open(f"/proc/{pid}/stat") as f:
                if int(f.read().rsplit(")", 1)[1].split()[2]) != pgid:
                    continue
            with open(f"/proc/{pid}/status") as f:
                total += next(int(ln.split()[1]) for ln in f if ln.startswith("VmRSS:"))
        except (OSError, StopIteration, ValueError, IndexError):
            continue
    return total


def test_hostile_kv_transfer_params_cost_one_local_request(
    pd: dict[str, Any], models: dict[str, Path]
) -> None:
    """Attacks 1 and 2 of issue 22 against a running consumer: ``Infinity`` as a port or
    TP size once raised OverflowError in the scheduler and killed the engine; a TP size
    of 10^7 once allocated 2.8 GB over 13 s before any cap applied."""
    eng, prompts = pd["same"], make_prompts(models["producer"], 1, seed=13)
    local = _generate(eng, prompts, [None])
    want = local["outputs"][0]["token_ids"]
    good = _prefill(pd["producer"], prompts)[0]
    hostile = [
        {**good, "remote_port": math.inf},
        {**good, "remote_port": -math.inf},
        {**good, "remote_port": math.nan},
        {**good, "tp_size": math.inf},
        {**good, "remote_port": 70000},
        {**good, "remote_port": "eighty"},
        {**good, "tp_size": {"a": [1, {"b": 2}]}},
        {**good, "remote_engine_id": {"nested": [1, 2]}},
        {**good, "remote_request_id": ["x", "y"]},
        {**good, "remote_host": {"h": 1}},
    ]
    r = _generate(eng, prompts * len(hostile), hostile)
    for o in r["outputs"]:
        assert o["token_ids"] == want  # computed locally
        assert not (o.get("kv_transfer_params") or {}).get("omni_kv_load")  # nothing loaded

    before = _rss_kib(eng.proc.pid)
    r = _generate(eng, prompts, [{**good, "tp_size": 10**7}])
    grown_kib = _rss_kib(eng.proc.pid) - before
    assert r["outputs"][0]["token_ids"] == want
    assert grown_kib < 8 * 1024, f"RSS grew by {grown_kib} KiB"
    assert r["seconds"] < 3 * local["seconds"] + 2.0, (r["seconds"], local["seconds"])
    refused = [ln for ln in eng.log_lines if "kv_transfer_params with do_remote_prefill are" in ln]
    assert len(refused) >= len(hostile) + 1, refused[-3:]

    r = _generate(eng, prompts, [good])  # still serving: the genuine params load the KV
    assert r["outputs"][0]["kv_transfer_params"]["omni_kv_load"]["ok"] is True
    assert r["outputs"][0]["token_ids"] == want
