"""The demo's requests: prompts, one request and its answer, TTFT from a server's metrics,
and the P/D and colocated runs over a list of prompts."""

from __future__ import annotations

import time
from dataclasses import dataclass
from typing import Any

import requests
from services import DemoError, Service

MODEL_NAME = "omnikv-demo-pd"
MAX_TOKENS = 16


@dataclass
class Prompt:
    kind: str  # "completion" | "chat"
    body: dict[str, Any]
    label: str


def build_prompts(n: int, quick: bool) -> list[Prompt]:
    from vllm_omni_kv.tiny_model import prompt_text

    out = []
    for i in range(n):
        # a few hundred tokens each, lengths cycling so any --requests fits max-model-len
        words = (90 + 40 * (i % 4)) if quick else (160 + 70 * (i % 6))
        text = prompt_text(100 + i, words)
        if i % 2 == 0:
            out.append(Prompt("completion", {"prompt": text}, text))
        else:
            msgs = [
                {"role": "system", "content": "you are a kv cache transfer engine"},
                {"role": "user", "content": text},
            ]
            out.append(Prompt("chat", {"messages": msgs}, text))
    return out


def _metric_sums(base: str, names: tuple[str, ...]) -> dict[str, float]:
    """``<name>_sum`` and ``<name>_count`` of Prometheus histograms at ``base/metrics``."""
    r = requests.get(base + "/metrics", timeout=5)
    r.raise_for_status()
    want = {f"{n}_{s}" for n in names for s in ("sum", "count")}
    out = dict.fromkeys(want, 0.0)
    for line in r.text.splitlines():
        if line.startswith("#"):
            continue
        key = line.split("{", 1)[0].split(" ", 1)[0]
        if key in want:
            out[key] += float(line.rsplit(" ", 1)[1])
    return out


TTFT = "vllm:time_to_first_token_seconds"


def ttft_since(base: str, before: dict[str, float], wait: float = 5.0) -> float | None:
    """The TTFT the server at ``base`` recorded for the one request since ``before``."""
    deadline = time.monotonic() + wait
    while True:  # the stats are recorded just after the response is sent
        now = _metric_sums(base, (TTFT,))
        dn = now[TTFT + "_count"] - before[TTFT + "_count"]
        if dn >= 1:
            return (now[TTFT + "_sum"] - before[TTFT + "_sum"]) / dn
        if time.monotonic() > deadline:
            return None
        time.sleep(0.05)


def send(
    base: str, p: Prompt, timeout: float, salt: str | None = None
) -> tuple[dict[str, Any], float]:
    path = "/v1/completions" if p.kind == "completion" else "/v1/chat/completions"
    body: dict[str, Any] = {
        "model": MODEL_NAME,
        **p.body,
        "max_tokens": MAX_TOKENS,
        "temperature": 0,
        "ignore_eos": True,
        "return_token_ids": True,
    }
    if salt is not None:
        body["cache_salt"] = salt
    t0 = time.perf_counter()
    try:
        r = requests.post(base + path, json=body, timeout=timeout)
    except requests.RequestException as e:
        raise DemoError(f"POST {base}{path} failed: {e}") from None
    dt = time.perf_counter() - t0
    if r.status_code != 200:
        raise DemoError(f"POST {base}{path} answered {r.status_code}: {r.text[:500]}")
    data: dict[str, Any] = r.json()
    return data, dt


def answer(data: dict[str, Any], kind: str) -> tuple[str, list[int]]:
    choice = data["choices"][0]
    text = choice["text"] if kind == "completion" else choice["message"]["content"]
    return text or "", list(choice.get("token_ids") or [])


def ms(x: float | None) -> str:
    return "n/a" if x is None else f"{x * 1e3:.1f} ms"


def size_text(n: int) -> str:
    if n < 1024:
        return f"{n} B"
    x = n / 1024
    for unit in ("KiB", "MiB"):
        if x < 1024:
            return f"{x:.2f} {unit}"
        x /= 1024
    return f"{x:.2f} GiB"


def run_pd(
    prompts: list[Prompt], proxy: Service, prod: Service, cons: Service
) -> list[dict[str, Any]]:
    results = []
    for i, p in enumerate(prompts, 1):
        pb = _metric_sums(prod.url, (TTFT,))
        cb = _metric_sums(cons.url, (TTFT,))
        data, dt = send(proxy.url, p, timeout=120)
        text, ids = answer(data, p.kind)
        load = (data.get("kv_transfer_params") or {}).get("omni_kv_load") or {}
        res = {
            "kind": p.kind,
            "prompt_tokens": data["usage"]["prompt_tokens"],
            "text": text,
            "token_ids": ids,
            "latency_s": dt,
            "ttft_s": ttft_since(cons.url, cb),
            "prefill_s": ttft_since(prod.url, pb),
            "kv_ok": bool(load.get("ok")),
            "kv_bytes": int(load.get("bytes") or 0),
            "kv_tokens": int(load.get("tokens") or 0),
            "kv_load_s": load.get("seconds"),
            "kv_error": load.get("error") or (None if load else "no omni_kv_load in the answer"),
        }
        results.append(res)
        kv = (
            f"KV {size_text(res['kv_bytes'])} ({res['kv_tokens']} tokens) loaded in "
            f"{ms(res['kv_load_s'])}"
            if res["kv_ok"]
            else f"KV NOT transferred ({res['kv_error']}); the consumer recomputed the prompt"
        )
        print(
            f"  [{i}/{len(prompts)}] {p.kind:<10} {res['prompt_tokens']:>4} prompt tokens -> {text!r}"
        )
        print(
            f"        TTFT at consumer {ms(res['ttft_s'])} | {kv} | prefill at producer "
            f"{ms(res['prefill_s'])} | end-to-end via proxy {ms(dt)}",
            flush=True,
        )
    return results


def run_colocated(
    prompts: list[Prompt], srv: Service, salt: str | None = None
) -> list[dict[str, Any]]:
    """The prompts on one server that prefills and decodes (``salt``: the ``cache_salt``)."""
    results: list[dict[str, Any]] = []
    for i, p in enumerate(prompts, 1):
        before = _metric_sums(srv.url, (TTFT,))
        data, dt = send(srv.url, p, timeout=120, salt=salt)
        load = (data.get("kv_transfer_params") or {}).get("omni_kv_load")
        if load is not None:
            raise DemoError(f"the colocated reference {srv.name} loaded KV ({load}): not colocated")
        text, ids = answer(data, p.kind)
        results.append(
            {"text": text, "token_ids": ids, "latency_s": dt, "ttft_s": ttft_since(srv.url, before)}
        )
        print(
            f"  [{i}/{len(prompts)}] {p.kind:<10} TTFT {ms(results[-1]['ttft_s'])} | "
            f"end-to-end {ms(dt)}",
            flush=True,
        )
    return results


def warm_up(base: str, what: str) -> None:
    """One untimed request: the first one pays one-time costs (allocations, lazy init)."""
    from vllm_omni_kv.tiny_model import prompt_text

    p = Prompt("completion", {"prompt": prompt_text(7, 64)}, "warm-up")
    data, dt = send(base, p, timeout=120)
    load = (data.get("kv_transfer_params") or {}).get("omni_kv_load")
    note = ""
    if load is not None and not load.get("ok"):
        note = f"; its KV was NOT transferred: {load.get('error')}"
    print(f"  warm-up request through the {what} (not counted): {ms(dt)}{note}", flush=True)


def mean(xs: list[float | None]) -> float | None:
    vals = [x for x in xs if x is not None]
    return sum(vals) / len(vals) if vals else None
