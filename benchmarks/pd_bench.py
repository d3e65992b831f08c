"""Prefill/decode benchmark: colocated vs OmniKVConnector (shm, mooncake) vs ExampleConnector.

Workload (defaults): 16 prompts of ~1,000 tokens, 16 output tokens, greedy, on a
generated tiny Llama whose KV per token is realistic (8 layers, 8 KV heads,
head size 128, bf16: 32 KiB per token), so moving KV, not computing, dominates
a P/D consumer's time to first token. Every configuration runs in this one
invocation, engines in subprocesses (at most two at a time):

* ``colocated``: one engine prefills and decodes;
* ``omnikv_<backend>``: a producer prefills (``max_tokens=1``, ``do_remote_decode``),
  a consumer generates with the transferred KV (``shm``: one copy from the producer's
  cache, the default; ``shm_packed``: ``share_cache: false``, packed frames;
  ``mooncake`` and ``nixl``: pulled over TCP loopback; ``nixl_spin``: the same with
  ``nixl_progress_wait_us: 0``, NIXL's own busy-polling progress threads);
* ``example_connector``: vLLM's built-in ``ExampleConnector`` (safetensors files in
  a directory under /tmp, its default storage).

Measured per configuration (wall clock around ``LLM.generate`` of the whole batch,
median of ``--repeats`` runs after a warm-up pass over the whole workload):
``ttft_s`` (consumer time to first token: a ``max_tokens=1`` run), ``total_s`` (a
``max_tokens=16`` run), ``prefill_s`` (producer), KV bytes moved and GB/s
(bytes / consumer TTFT), and how many prompts gave the colocated tokens.
Prefix caching is off so that repeated prompts are recomputed or re-transferred.

For OmniKV also, for requests sent one at a time (each load of a complete payload
runs alone): ``single_write_GBps``, the consumer's verify + write into its cache
(``omni_kv_load.write_seconds``), and ``single_load_GBps``, the whole load as the
worker times it (also claiming and parsing the payload), each against one thread's
memmove of the same bytes between cold buffers measured right after that load
(``memcpy_GBps``; ratios are per load, medians reported); and ``prefix_hits``: a
consumer with prefix caching on loads prompts cold, then prompts whose first 60% it
holds, and the bytes moved per loaded token of the two rounds are compared.

    python benchmarks/pd_bench.py            # writes benchmarks/results/pd_bench.{json,png}
    python benchmarks/pd_bench.py --backends nixl,nixl_spin --skip prefix,example \\
        --name pd_bench_nixl                 # NIXL with and without spinning progress threads
"""

from __future__ import annotations

import argparse
import ctypes
import importlib.util
import json
import os
import shutil
import tempfile
import time
from pathlib import Path
from typing import Any

import numpy as np

from vllm_omni_kv.testing.engine_proc import EngineProc as Engine

REPO = Path(__file__).resolve().parents[1]
PREFILL_PARAMS = {"do_remote_decode": True, "do_remote_prefill": False}


# -- engines: one subprocess each (vllm_omni_kv.testing.engine_proc, JSON lines, no pickle) --
def _start(
    specs: list[tuple[str, dict[str, Any]]], env: dict[str, str], log_dir: Path
) -> list[Engine]:
    engines = [Engine(c, env=env, log=log_dir / f"{n}.log") for n, c in specs]
    try:
        for e in engines:
            e.wait_ready(600)
    except BaseException:
        for e in engines:
            e.stop()
        raise
    return engines


def _generate(
    eng: Engine, prompts: list[list[int]], max_tokens: int, params: list[Any] | None = None
) -> dict[str, Any]:
    r = eng.generate(prompts, max_tokens, params, timeout=900.0, logprobs=2)
    if "error" in r:
        raise RuntimeError(f"generate failed: {r['error']}\n{eng.tail()}")
    return r


# -- measurements -----------------------------------------------------------------------
def _tokens(r: dict[str, Any]) -> list[list[int]]:
    return [o["token_ids"] for o in r["outputs"]]


def _top2(r: dict[str, Any]) -> list[list[list[float]]]:
    return [o["top2"] for o in r["outputs"]]


def _divergences(r: dict[str, Any], ref: dict[str, Any]) -> list[dict[str, Any]]:
    """Where a run's greedy tokens leave the colocated ones, and how close that choice was.

    ``*_margin`` is top-1 minus top-2 logprob at the first differing step: a margin near
    zero is a near-tie that any rounding difference can flip.
    """
    out = []
    for i, (got, want) in enumerate(zip(r["tokens"], ref["tokens"])):
        if got == want:
            continue
        step = next(j for j, (a, b) in enumerate(zip(got, want)) if a != b)
        ref_lp, lp = ref["top2"][i][step], r["top2"][i][step]
        out.append(
            {
                "prompt": i,
                "step": step,
                "colocated_margin": round(ref_lp[0] - ref_lp[1], 5),
                "margin": round(lp[0] - lp[1], 5),
            }
        )
    return out


def _matches(got: list[list[int]], ref: list[list[int]] | None) -> int | None:
    if ref is None:
        return None
    return sum(int(a == b) for a, b in zip(got, ref))


def _median(xs: list[float]) -> float:
    ys = sorted(xs)
    mid = len(ys) // 2
    return ys[mid] if len(ys) % 2 else (ys[mid - 1] + ys[mid]) / 2


def _summary(
    ttfts: list[float],
    totals: list[float],
    prefills: list[float],
    last: dict[str, Any],
    **extra: Any,
) -> dict[str, Any]:
    """Medians and samples of one configuration; tokens/logprobs of its last full run."""
    return {
        "ttft_s": _median(ttfts),
        "total_s": _median(totals),
        "prefill_s": _median(prefills),
        "ttft_samples": ttfts,
        "total_samples": totals,
        **extra,
        "tokens": _tokens(last),
        "top2": _top2(last),
    }


def run_colocated(
    base: dict[str, Any],
    prompts: list[list[int]],
    out_tokens: int,
    env: dict[str, str],
    log_dir: Path,
    repeats: int,
) -> dict[str, Any]:
    (eng,) = _start([("colocated", base)], env, log_dir)
    try:
        _generate(eng, prompts, 2)  # warm-up: the whole workload once (KV cache pages touched)
        ttfts, totals = [], []
        for _ in range(repeats):
            ttfts.append(_generate(eng, prompts, 1)["seconds"])
            total = _generate(eng, prompts, out_tokens)
            totals.append(total["seconds"])
    finally:
        eng.stop()
    return _summary(ttfts, totals, ttfts, total, kv_bytes=0)


def _pd_round(
    prod: Engine, cons: Engine, prompts: list[list[int]], max_tokens: int, with_params: bool
) -> tuple[dict[str, Any], dict[str, Any]]:
    pre = _generate(prod, prompts, 1, [PREFILL_PARAMS] * len(prompts) if with_params else None)
    params = [o["kv_transfer_params"] for o in pre["outputs"]] if with_params else None
    dec = _generate(cons, prompts, max_tokens, params)
    return pre, dec


def _omnikv_configs(
    base: dict[str, Any], backend: str, transfer_cpus: str
) -> tuple[dict[str, Any], dict[str, Any]]:
    """Producer and consumer engine configs of OmniKVConnector over ``backend``."""
    from vllm_omni_kv.testing.net import free_port

    pextra: dict[str, Any]
    cextra: dict[str, Any]
    if backend == "mooncake":
        common = {"protocol": "tcp", "host": "127.0.0.1", "memory_pool_size": 2 << 30}
        pextra = {
            "backend": "mooncake",
            "backend_extra": {**common, "role": "sender", "zmq_port": free_port()},
        }
        cextra = {"backend": "mooncake", "backend_extra": {**common, "role": "receiver"}}
    elif backend in ("nixl", "nixl_spin"):  # nixl_spin: NIXL's own busy-polling progress
        common = {"host": "127.0.0.1", "memory_pool_size": 2 << 30}  # thread, for contrast
        if backend == "nixl_spin":
            common["nixl_progress_wait_us"] = 0
        pextra = {
            "backend": "nixl",
            "backend_extra": {**common, "role": "sender", "zmq_port": free_port()},
        }
        cextra = {"backend": "nixl", "backend_extra": {**common, "role": "receiver"}}
    elif backend == "shm_packed":  # the two-copy path: frames packed by the producer
        pextra = cextra = {"backend": "shm", "backend_extra": {"share_cache": False}}
    else:  # "shm": pages copied from the producer's cache (the default)
        pextra = cextra = {"backend": backend}
    pextra = {**pextra, "transfer_cpus": transfer_cpus}
    cextra = {**cextra, "transfer_cpus": transfer_cpus}
    prod_cfg = dict(
        base,
        kv_transfer_config={
            "kv_connector": "OmniKVConnector",
            "kv_role": "kv_producer",
            "kv_connector_extra_config": pextra,
        },
    )
    cons_cfg = dict(
        base,
        kv_transfer_config={
            "kv_connector": "OmniKVConnector",
            "kv_role": "kv_consumer",
            "kv_load_failure_policy": "recompute",
            "kv_connector_extra_config": {**cextra, "recv_timeout": 60},
        },
    )
    return prod_cfg, cons_cfg


def run_omnikv(
    base: dict[str, Any],
    backend: str,
    prompts: list[list[int]],
    out_tokens: int,
    env: dict[str, str],
    log_dir: Path,
    repeats: int,
    transfer_cpus: str = "auto",
) -> dict[str, Any]:
    prod_cfg, cons_cfg = _omnikv_configs(base, backend, transfer_cpus)
    prod, cons = _start(
        [(f"omnikv_{backend}-producer", prod_cfg), (f"omnikv_{backend}-consumer", cons_cfg)],
        env,
        log_dir,
    )
    try:
        _pd_round(prod, cons, prompts, 2, True)  # warm-up: the whole workload once
        ttfts, totals, prefills, loads = [], [], [], []
        for _ in range(repeats):
            pre, first = _pd_round(prod, cons, prompts, 1, True)
            _, total = _pd_round(prod, cons, prompts, out_tokens, True)
            ttfts.append(first["seconds"])
            totals.append(total["seconds"])
            prefills.append(pre["seconds"])
            loads = [o["kv_transfer_params"]["omni_kv_load"] for o in first["outputs"]]
        # one request at a time: each load (verify + write into the cache) runs alone,
        # SETTLE_S after its prefill, once the producer's worker stopped busy-looping (both
        # engines share this host's two cores: the load would measure that contention)
        singles: list[dict[str, Any]] = []
        probe: MemcpyProbe | None = None
        for p in prompts:
            pre = _generate(prod, [p], 1, [PREFILL_PARAMS])
            time.sleep(SETTLE_S)
            dec = _generate(cons, [p], 1, [pre["outputs"][0]["kv_transfer_params"]])
            load = dict(dec["outputs"][0]["kv_transfer_params"]["omni_kv_load"])
            if load.get("ok") and int(load.get("bytes", 0)) > 0:
                probe = probe or MemcpyProbe(int(load["bytes"]))
                load["memcpy_GBps"] = probe.gbps()
            singles.append(load)
    finally:
        prod.stop()
        cons.stop()
    return _summary(
        ttfts,
        totals,
        prefills,
        total,
        kv_bytes=sum(int(x.get("bytes", 0)) for x in loads),
        loads_ok=sum(int(bool(x.get("ok"))) for x in loads),
        load_seconds_max=max(float(x.get("seconds", 0)) for x in loads),
        **_single_loads(singles),
    )


def _single_loads(loads: list[dict[str, Any]]) -> dict[str, Any]:
    """Per-load throughput of requests loaded one at a time, each against a memcpy of the
    same bytes measured right after it."""
    ok = [x for x in loads if x.get("ok") and float(x.get("write_seconds", 0)) > 0]
    ok = [x for x in ok if "memcpy_GBps" in x]
    if not ok:
        return {"single_loads_ok": 0}
    write = [int(x["bytes"]) / float(x["write_seconds"]) / 1e9 for x in ok]
    whole = [int(x["bytes"]) / float(x["seconds"]) / 1e9 for x in ok]
    memcpy = [float(x["memcpy_GBps"]) for x in ok]
    return {
        "single_loads_ok": len(ok),
        "single_load_bytes": int(_median([float(x["bytes"]) for x in ok])),
        "single_write_GBps": round(_median(write), 3),
        "single_write_GBps_samples": [round(g, 3) for g in write],
        "single_load_GBps": round(_median(whole), 3),
        "single_load_GBps_samples": [round(g, 3) for g in whole],
        "memcpy_GBps": round(_median(memcpy), 3),
        "memcpy_GBps_samples": [round(g, 3) for g in memcpy],
        "single_write_vs_memcpy": round(_median([w / m for w, m in zip(write, memcpy)]), 3),
        "single_load_vs_memcpy": round(_median([w / m for w, m in zip(whole, memcpy)]), 3),
    }


#: pause between a single load's prefill and its decode (seconds): vLLM's workers
#: busy-loop for 1 s after each step (``SpinCondition.busy_loop_s`` in shm_broadcast)
SETTLE_S = 1.2

#: memcpy trials rotate through buffers this large in all, well past the last-level cache,
#: so each copy starts cold, as a load does (the producer wrote its segment long before)
MEMCPY_POOL_BYTES = 512 << 20


class MemcpyProbe:
    """One thread's ``memmove`` of ``nbytes`` from a cold buffer to a cold buffer."""

    def __init__(self, nbytes: int) -> None:
        self.nbytes = nbytes
        pairs = max(2, -(-MEMCPY_POOL_BYTES // (2 * nbytes)))
        self.pool = []
        for _ in range(pairs):
            src = np.random.default_rng(0).integers(0, 255, nbytes, dtype=np.uint8)
            dst = np.empty_like(src)
            dst[:] = src  # pre-fault both: no page faults in the timed copy
            self.pool.append((src, dst))
        self._next = 0

    def gbps(self, repeats: int = 5) -> float:
        """Median GB/s of ``repeats`` copies, each between buffers not touched recently."""
        times = []
        for _ in range(repeats):
            src, dst = self.pool[self._next % len(self.pool)]
            self._next += 1
            t0 = time.perf_counter()
            ctypes.memmove(dst.ctypes.data, src.ctypes.data, self.nbytes)
            times.append(time.perf_counter() - t0)
        return self.nbytes / _median(times) / 1e9


def run_prefix(
    base: dict[str, Any],
    backend: str,
    prompts: list[list[int]],
    fresh: list[list[int]],
    env: dict[str, str],
    log_dir: Path,
) -> dict[str, Any]:
    """Bytes per loaded token of cold requests vs requests whose prefix the consumer holds.

    The consumer runs with prefix caching on. Round 1 loads ``prompts`` cold; round 2
    sends each prompt's first 60% followed by new tokens, so the consumer already
    holds the leading blocks and only the rest should cross the transport.
    """
    prod_cfg, cons_cfg = _omnikv_configs(base, backend, "auto")
    cons_cfg["enable_prefix_caching"] = True
    prod, cons = _start(
        [(f"prefix_{backend}-producer", prod_cfg), (f"prefix_{backend}-consumer", cons_cfg)],
        env,
        log_dir,
    )
    try:
        _, cold = _pd_round(prod, cons, prompts, 1, True)
        ext = [
            p[: int(len(p) * 0.6)] + f[: len(p) - int(len(p) * 0.6)] for p, f in zip(prompts, fresh)
        ]
        _, hit = _pd_round(prod, cons, ext, 1, True)
    finally:
        prod.stop()
        cons.stop()
    c = [o["kv_transfer_params"]["omni_kv_load"] for o in cold["outputs"]]
    h = [o["kv_transfer_params"]["omni_kv_load"] for o in hit["outputs"]]
    per_cold = sum(int(x["bytes"]) for x in c) / max(1, sum(int(x["tokens"]) for x in c))
    per_hit = sum(int(x["bytes"]) for x in h) / max(1, sum(int(x["tokens"]) for x in h))
    return {
        "cold_loads_ok": sum(int(bool(x.get("ok"))) for x in c),
        "hit_loads_ok": sum(int(bool(x.get("ok"))) for x in h),
        "cold_tokens_loaded": sum(int(x["tokens"]) for x in c),
        "hit_tokens_loaded": sum(int(x["tokens"]) for x in h),
        "hit_prompt_tokens": sum(len(p) for p in ext),
        "cold_bytes_per_token": round(per_cold, 1),
        "hit_bytes_per_token": round(per_hit, 1),
        "hit_vs_cold_bytes_per_token": round(per_hit / per_cold, 3),
    }


def run_example(
    base: dict[str, Any],
    prompts: list[list[int]],
    out_tokens: int,
    env: dict[str, str],
    log_dir: Path,
    repeats: int,
) -> dict[str, Any]:
    store = Path(tempfile.mkdtemp(prefix="pd_bench_example_", dir="/tmp"))
    extra = {"shared_storage_path": str(store)}
    prod_cfg = dict(
        base,
        kv_transfer_config={
            "kv_connector": "ExampleConnector",
            "kv_role": "kv_producer",
            "kv_connector_extra_config": extra,
        },
    )
    cons_cfg = dict(
        base,
        kv_transfer_config={
            "kv_connector": "ExampleConnector",
            "kv_role": "kv_consumer",
            "kv_connector_extra_config": extra,
        },
    )
    try:
        prod, cons = _start(
            [("example-producer", prod_cfg), ("example-consumer", cons_cfg)], env, log_dir
        )
        try:
            _pd_round(prod, cons, prompts, 2, False)  # warm-up: the whole workload once
            ttfts, totals, prefills = [], [], []
            for _ in range(repeats):
                shutil.rmtree(store, ignore_errors=True)
                store.mkdir()
                pre = _generate(prod, prompts, 1)
                nbytes = sum(f.stat().st_size for f in store.rglob("*") if f.is_file())
                first = _generate(cons, prompts, 1)
                total = _generate(cons, prompts, out_tokens)  # the files are still there
                ttfts.append(first["seconds"])
                totals.append(total["seconds"])
                prefills.append(pre["seconds"])
        finally:
            prod.stop()
            cons.stop()
    finally:
        shutil.rmtree(store, ignore_errors=True)
    return _summary(ttfts, totals, prefills, total, kv_bytes=nbytes)


def _plot(results: dict[str, dict[str, Any]], path: Path, title: str) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    names = list(results)
    fig, axes = plt.subplots(1, 2, figsize=(11, 4))
    for ax, key, label in (
        (axes[0], "ttft_s", "consumer TTFT (s)"),
        (axes[1], "total_s", "total, 16 output tokens (s)"),
    ):
        vals = [results[n][key] for n in names]
        bars = ax.bar(
            names, vals, color=["#888888", "#2a7ab0", "#5aa05a", "#c0504d", "#9a7ab0"][: len(names)]
        )
        ax.set_ylabel(label)
        ax.set_yscale("log")
        for b, v in zip(bars, vals):
            ax.annotate(
                f"{v:.3f}", (b.get_x() + b.get_width() / 2, v), ha="center", va="bottom", fontsize=8
            )
        ax.tick_params(axis="x", rotation=20)
    fig.suptitle(title, fontsize=9)
    fig.tight_layout()
    fig.savefig(path, dpi=120)
    plt.close(fig)


def main(argv: list[str] | None = None) -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--prompts", type=int, default=16)
    ap.add_argument("--prompt-tokens", type=int, default=1000)
    ap.add_argument("--output-tokens", type=int, default=16)
    ap.add_argument("--layers", type=int, default=8)
    ap.add_argument("--kv-heads", type=int, default=8)
    ap.add_argument("--head-dim", type=int, default=128)
    ap.add_argument("--hidden", type=int, default=512)
    ap.add_argument(
        "--dtype", default="auto", help="model dtype; auto: bfloat16 where the CPU has it natively"
    )
    ap.add_argument("--repeats", type=int, default=3, help="measured runs (median reported)")
    ap.add_argument(
        "--backends",
        default="shm,mooncake",
        help="OmniKV backends to run: shm, shm_packed, mooncake, nixl, nixl_spin",
    )
    ap.add_argument(
        "--transfer-cpus", default="auto", help="OmniKV transfer_cpus (auto, inherit, a list)"
    )
    ap.add_argument("--skip", default="", help="comma list of: colocated,omnikv,prefix,example")
    ap.add_argument("--out", type=Path, default=REPO / "benchmarks" / "results")
    ap.add_argument("--name", default="pd_bench", help="file name of the JSON and PNG")
    a = ap.parse_args(argv)

    from transformers import AutoTokenizer

    from vllm_omni_kv.tiny_model import TinyModelSpec, fast_cpu_dtype, prompt_text, write_tiny_model

    dtype_reason = "--dtype"
    if a.dtype == "auto":
        a.dtype, dtype_reason = fast_cpu_dtype()
    print(f"dtype {a.dtype} ({dtype_reason})")

    spec = TinyModelSpec(
        num_layers=a.layers,
        hidden_size=a.hidden,
        num_attention_heads=a.kv_heads,
        num_kv_heads=a.kv_heads,
        head_dim=a.head_dim,
        intermediate_size=2 * a.hidden,
        dtype=a.dtype,
    )
    model = write_tiny_model(REPO / ".cache" / "tiny-models" / f"llama-{spec.fingerprint()}", spec)
    tok = AutoTokenizer.from_pretrained(str(model))
    prompts = []
    for i in range(a.prompts):
        ids = tok(prompt_text(100 + i, a.prompt_tokens))["input_ids"]
        prompts.append(list(ids[: a.prompt_tokens]))
    n_tokens = sum(len(p) for p in prompts)
    itemsize = 2 if a.dtype in ("bfloat16", "float16") else 4
    kv_per_token = a.layers * 2 * a.kv_heads * a.head_dim * itemsize
    cache_gib = max(1, -(-int(1.5 * (n_tokens + a.prompts * 64) * kv_per_token) // (1 << 30)))
    env = dict(
        os.environ,
        VLLM_CPU_KVCACHE_SPACE=str(cache_gib),
        VLLM_LOGGING_LEVEL=os.environ.get("VLLM_LOGGING_LEVEL", "WARNING"),
        MC_LOG_LEVEL="ERROR",
    )
    base = {
        "model": str(model),
        "dtype": a.dtype,
        "max_model_len": a.prompt_tokens + a.output_tokens + 64,
        "max_num_seqs": a.prompts,
        # one step holds the whole batch: ExampleConnector cannot save chunked prefills
        "max_num_batched_tokens": max(8192, n_tokens + a.prompts * 64),
        "enable_prefix_caching": False,
    }
    a.out.mkdir(parents=True, exist_ok=True)
    log_dir = Path(tempfile.mkdtemp(prefix="pd_bench_logs_"))
    skip = set(filter(None, a.skip.split(",")))
    results: dict[str, dict[str, Any]] = {}
    prefix: dict[str, dict[str, Any]] = {}
    fresh = []  # new tokens that extend a prompt the consumer holds (prefix-hit phase)
    for i in range(a.prompts):
        fresh.append(
            list(tok(prompt_text(500 + i, a.prompt_tokens))["input_ids"][: a.prompt_tokens])
        )
    print(
        f"model {model.name}: {n_tokens} prompt tokens, {kv_per_token} B KV/token; logs in {log_dir}"
    )
    if "colocated" not in skip:
        results["colocated"] = run_colocated(
            base, prompts, a.output_tokens, env, log_dir, a.repeats
        )
        print(
            "colocated",
            {k: v for k, v in results["colocated"].items() if k not in ("tokens", "top2")},
        )
    if "omnikv" not in skip:
        for backend in filter(None, a.backends.split(",")):
            if backend == "mooncake" and importlib.util.find_spec("mooncake") is None:
                print("mooncake: transfer engine not importable, skipped")
                continue
            if backend.startswith("nixl") and importlib.util.find_spec("nixl") is None:
                print(f"{backend}: nixl not importable, skipped")
                continue
            key = f"omnikv_{backend}"
            results[key] = run_omnikv(
                base, backend, prompts, a.output_tokens, env, log_dir, a.repeats, a.transfer_cpus
            )
            print(key, {k: v for k, v in results[key].items() if k not in ("tokens", "top2")})
            if "prefix" not in skip:
                prefix[backend] = run_prefix(base, backend, prompts, fresh, env, log_dir)
                print(f"prefix hits, {backend}:", prefix[backend])
    if "example" not in skip:
        results["example_connector"] = run_example(
            base, prompts, a.output_tokens, env, log_dir, a.repeats
        )
        print(
            "example_connector",
            {k: v for k, v in results["example_connector"].items() if k not in ("tokens", "top2")},
        )

    ref = results.get("colocated", {}).get("tokens")
    for r in results.values():
        r["matches_colocated"] = _matches(r["tokens"], ref)
        if ref is not None and r is not results["colocated"]:
            r["divergences"] = _divergences(r, results["colocated"])
        r["kv_GBps"] = round(r["kv_bytes"] / r["ttft_s"] / 1e9, 3) if r["kv_bytes"] else 0.0
    summary: dict[str, Any] = {}
    ex = results.get("example_connector")
    co = results.get("colocated")
    for name, r in results.items():
        if name.startswith("omnikv"):
            summary[name] = {
                "ttft_vs_example_connector": round(r["ttft_s"] / ex["ttft_s"], 3) if ex else None,
                "ttft_vs_colocated_prefill": round(r["ttft_s"] / co["ttft_s"], 3) if co else None,
                "target_met": bool(
                    ex and co and r["ttft_s"] <= 0.5 * ex["ttft_s"] and r["ttft_s"] < co["ttft_s"]
                ),
                "single_write_vs_memcpy": r.get("single_write_vs_memcpy"),
                "single_load_vs_memcpy": r.get("single_load_vs_memcpy"),
                "load_target_met": bool((r.get("single_write_vs_memcpy") or 0) >= 0.6),
            }
            pre = prefix.get(name.removeprefix("omnikv_"))
            if pre:
                summary[name]["hit_vs_cold_bytes_per_token"] = pre["hit_vs_cold_bytes_per_token"]
                summary[name]["prefix_target_met"] = pre["hit_vs_cold_bytes_per_token"] <= 1.25
    report = {
        "workload": {
            "prompts": a.prompts,
            "prompt_tokens": [len(p) for p in prompts],
            "output_tokens": a.output_tokens,
            "model": {
                k: getattr(spec, k)
                for k in ("num_layers", "hidden_size", "num_kv_heads", "head_dim", "dtype")
            },
            "kv_bytes_per_token": kv_per_token,
            "dtype_reason": dtype_reason,
            "prefix_caching": False,
            "host_cpus": os.cpu_count(),
        },
        "results": {
            n: {k: v for k, v in r.items() if k not in ("tokens", "top2")}
            for n, r in results.items()
        },
        "prefix_hits": prefix,
        "summary": summary,
    }
    (a.out / f"{a.name}.json").write_text(json.dumps(report, indent=2))
    _plot(
        report["results"],
        a.out / f"{a.name}.png",
        f"{a.prompts} prompts x {a.prompt_tokens} tokens, {a.output_tokens} output tokens; "
        f"{a.layers} layers, {a.kv_heads} KV heads x {a.head_dim}, {a.dtype}; {os.cpu_count()} CPUs",
    )
    print(json.dumps(report["summary"], indent=2))
    print(f"wrote {a.out / a.name}.json and .png")


if __name__ == "__main__":
    main()
