"""Load through ``vllm serve``: a producer and a consumer (shared memory) behind the example
proxy (the session's ``example_pd``, shared with test_pd_serve), 36 concurrent streaming
requests of which 12 hang up mid-stream.

Asserted: every request that is not aborted streams the tokens a colocated engine gives
for its prompt (the producer answers requests without transfer parameters as an ordinary
engine), the servers stay healthy, nothing is left behind once ``send_ttl`` has passed (no
payload held by the producer, no KV blocks in use, and by the namespace's shared-memory
inventory no payload, hold, orphan or payload segment in use), and a follow-up run completes with the same tokens.
"""

from __future__ import annotations

import asyncio
import json
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import aiohttp
import pytest
import requests
from pd_helpers import LOG_DIR, SERVE_NAMESPACE, make_prompts
from serve_helpers import EXAMPLE_SEND_TTL, MAX_MODEL_LEN, Servers, metric

from vllm_omni_kv.backends.shm.inventory import inventory

pytestmark = [pytest.mark.e2e, pytest.mark.slow]

#: seconds the producer keeps a payload nobody claimed (the example's 300, shortened)
SEND_TTL = EXAMPLE_SEND_TTL
REQUESTS = 36
#: every third request hangs up: 12 of 36 (33%)
ABORT_EVERY = 3
MAX_TOKENS = 32
#: a request that hangs up asks for as many tokens as its context has room for: one whose
#: hang-up never reached the decode server runs all of them, while delivering a hang-up takes
#: a few decode steps on an idle machine and can take over a second on a loaded one (client,
#: proxy and both servers share two cores), longer than 256 tokens take
ABORTED_MAX_TOKENS = 1536
GREEDY = {"max_tokens": MAX_TOKENS, "temperature": 0, "ignore_eos": True}


@pytest.fixture
def stack(example_pd: Servers) -> Servers:
    """The session's example deployment (shared with test_pd_serve)."""
    return example_pd


@dataclass
class Outcome:
    text: str
    chunks: int
    aborted: bool
    finish_reason: str | None = None


async def _stream(
    session: aiohttp.ClientSession, url: str, body: dict[str, Any], abort_after: int | None
) -> Outcome:
    """One streaming completion; with ``abort_after`` hang up after that many chunks."""
    text, chunks, finish = "", 0, None
    resp = await session.post(url, json={**body, "stream": True})
    try:
        assert resp.status == 200, await resp.text()
        if abort_after == 0:  # hang up before the first token (prefill or KV load)
            return Outcome("", 0, True)
        async for raw in resp.content:
            line = raw.strip()
            if not line.startswith(b"data: ") or line == b"data: [DONE]":
                continue
            choice = json.loads(line[6:])["choices"][0]
            text += choice["text"]
            finish = choice.get("finish_reason") or finish
            chunks += 1
            if abort_after is not None and chunks >= abort_after:
                return Outcome(text, chunks, True)
        return Outcome(text, chunks, False, finish)
    finally:
        resp.close()  # an abort: the connection is dropped, not drained


def _abort_plan(i: int) -> int | None:
    """Request ``i``: None (completes), or after how many chunks it hangs up."""
    if i % ABORT_EVERY != ABORT_EVERY - 1:
        return None
    return 0 if (i // ABORT_EVERY) % 3 == 0 else 2


async def _run(stack: Servers, prompts: list[list[int]], plan: list[int | None]) -> list[Outcome]:
    timeout = aiohttp.ClientTimeout(total=300)
    async with aiohttp.ClientSession(timeout=timeout) as s:
        return await asyncio.gather(
            *(
                _stream(
                    s,
                    stack.proxy + "/v1/completions",
                    {
                        "model": stack.model,
                        "prompt": p,
                        **GREEDY,
                        **({} if a is None else {"max_tokens": ABORTED_MAX_TOKENS}),
                    },
                    a,
                )
                for p, a in zip(prompts, plan)
            )
        )


def _reference(stack: Servers, prompts: list[list[int]]) -> list[str]:
    """Colocated answers: the producer without transfer parameters, one batch."""
    r = requests.post(
        stack.prefill + "/v1/completions",
        json={"model": stack.model, "prompt": prompts, **GREEDY},
        timeout=300,
    )
    assert r.status_code == 200, r.text
    choices = sorted(r.json()["choices"], key=lambda c: c["index"])
    return [c["text"] for c in choices]


def _healthy(stack: Servers) -> None:
    for base in (stack.prefill, stack.decode, stack.proxy):
        assert requests.get(base + "/health", timeout=10).status_code == 200, base


def _idle(base: str, deadline_s: float) -> None:
    deadline = time.monotonic() + deadline_s
    while time.monotonic() < deadline:
        if not metric(base, "vllm:num_requests_running") + metric(
            base, "vllm:num_requests_waiting"
        ):
            return
        time.sleep(0.2)
    pytest.fail(f"{base} still has requests after {deadline_s:.0f}s")


def _left_behind() -> int:
    """This run's shared-memory files other than the producer's live arena (its cache and
    FREE payload segments): payloads, holds, entries in flight, orphans, foreign files and
    payload segments in use."""
    inv = inventory(SERVE_NAMESPACE)
    return (
        inv.payloads + inv.holds + inv.transient + inv.orphans + inv.foreign + inv.segments_in_use
    )


def _settled(stack: Servers, deadline_s: float) -> dict[str, float]:
    """Wait until nothing is running, held or left in /dev/shm; return what remains."""
    deadline = time.monotonic() + deadline_s
    state: dict[str, float] = {}
    while time.monotonic() < deadline:
        # a step of the producer: its connector reports stats (the held gauge) only then
        poke = {"model": stack.model, "prompt": [1, 2, 3], "max_tokens": 1}
        requests.post(stack.prefill + "/v1/completions", json=poke, timeout=60)
        state = {
            f"{side}:{m}": metric(base, f"vllm:{m}")
            for side, base in (("producer", stack.prefill), ("consumer", stack.decode))
            for m in ("num_requests_running", "num_requests_waiting", "kv_cache_usage_perc")
        }
        state["producer:omnikv_payloads_held"] = metric(stack.prefill, "vllm:omnikv_payloads_held")
        state["shm_files_left"] = float(_left_behind())
        if not any(state.values()):
            return state
        time.sleep(0.5)
    return state


def test_concurrent_streams_with_aborts_then_no_leak_and_a_clean_rerun(
    stack: Servers, tiny_model_dir: Path
) -> None:
    prompts = [
        p for s in range(REQUESTS // 4) for p in make_prompts(tiny_model_dir, 4, seed=60 + s)
    ]
    assert len(prompts) == REQUESTS and len({tuple(p) for p in prompts}) == REQUESTS
    assert max(map(len, prompts)) + ABORTED_MAX_TOKENS <= MAX_MODEL_LEN
    ref = _reference(stack, prompts)
    loads_before = metric(stack.decode, "vllm:omnikv_loads_total")
    tokens_before = metric(stack.decode, "vllm:generation_tokens_total")
    plan = [_abort_plan(i) for i in range(REQUESTS)]
    assert sum(a is not None for a in plan) / REQUESTS >= 0.25

    t0 = time.monotonic()
    got = asyncio.run(_run(stack, prompts, plan))
    done = [(o, want) for o, want in zip(got, ref) if not o.aborted]
    assert len(done) == REQUESTS - sum(a is not None for a in plan)
    for o, want in done:
        assert o.finish_reason == "length" and o.text == want
    loaded = metric(stack.decode, "vllm:omnikv_loads_total") - loads_before
    # the completed requests' KV came from the producer (none was cached on the consumer)
    assert loaded >= len(done), (loaded, len(done))
    # the hang-ups reached the decode server (proxy -> consumer): the aborted requests
    # stopped generating instead of running to max_tokens
    _idle(stack.decode, deadline_s=30)
    extra = metric(stack.decode, "vllm:generation_tokens_total") - tokens_before
    extra -= len(done) * MAX_TOKENS
    aborted = REQUESTS - len(done)
    assert 0 <= extra < aborted * ABORTED_MAX_TOKENS / 2, (extra, aborted)
    _healthy(stack)

    # payloads of requests aborted before their load expire after send_ttl
    time.sleep(max(0.0, SEND_TTL + 1 - (time.monotonic() - t0)))
    again = [p for s in range(3) for p in make_prompts(tiny_model_dir, 4, seed=90 + s)]
    ref2 = _reference(stack, again)
    got2 = asyncio.run(_run(stack, again, [None] * len(again)))
    assert [o.text for o in got2] == ref2
    assert all(o.finish_reason == "length" for o in got2)
    state = _settled(stack, deadline_s=30)
    assert not any(state.values()), (state, inventory(SERVE_NAMESPACE))
    _healthy(stack)
    (LOG_DIR / "load-test-state.json").write_text(json.dumps(state, indent=2))
