"""A small prefill/decode proxy for two ``vllm serve`` processes (NIXL's protocol).

For each ``/v1/completions`` or ``/v1/chat/completions`` request:

1. send it to the producer (prefill server) with ``max_tokens=1``, non-streaming,
   and ``kv_transfer_params={"do_remote_decode": true, "do_remote_prefill": false}``;
2. send the original request to the consumer (decode server) with the
   ``kv_transfer_params`` the producer returned, and relay its answer
   (streamed when the client asked for a stream).

If the prefill step fails, the request still goes to the consumer, without
transfer parameters: it then prefills locally (slower, same tokens). A client that
hangs up ends the upstream request of whichever step is running (the server aborts it).

    python examples/disaggregated_prefill/proxy.py --port 8000 \\
        --prefill http://127.0.0.1:8100 --decode http://127.0.0.1:8200

``GET /health`` answers 200 when both upstreams are healthy, else 503.
"""

from __future__ import annotations

import argparse
import asyncio
import itertools
import json
import logging
import time
from typing import Any

import aiohttp
from aiohttp import web

log = logging.getLogger("omnikv.proxy")

PREFILL_PARAMS = {"do_remote_decode": True, "do_remote_prefill": False}
#: fields a prefill request must not carry (it is one non-streamed token)
_DROP_FOR_PREFILL = ("stream", "stream_options", "max_completion_tokens", "n", "best_of")


class Proxy:
    def __init__(self, prefill: list[str], decode: list[str], timeout: float) -> None:
        self.prefill = itertools.cycle([u.rstrip("/") for u in prefill])
        self.decode = itertools.cycle([u.rstrip("/") for u in decode])
        self.prefill_urls = [u.rstrip("/") for u in prefill]
        self.decode_urls = [u.rstrip("/") for u in decode]
        self.timeout = aiohttp.ClientTimeout(total=timeout)
        self.session: aiohttp.ClientSession | None = None

    async def start(self, app: web.Application) -> None:
        self.session = aiohttp.ClientSession(timeout=self.timeout)

    async def stop(self, app: web.Application) -> None:
        if self.session is not None:
            await self.session.close()

    def _session(self) -> aiohttp.ClientSession:
        assert self.session is not None, "proxy not started"
        return self.session

    async def _prefill(self, path: str, body: dict[str, Any], headers: dict[str, str]) -> Any:
        req = {k: v for k, v in body.items() if k not in _DROP_FOR_PREFILL}
        req["max_tokens"] = 1
        req["stream"] = False
        req["kv_transfer_params"] = dict(PREFILL_PARAMS)
        url = next(self.prefill) + path
        t0 = time.perf_counter()
        try:
            async with self._session().post(url, json=req, headers=headers) as resp:
                if resp.status != 200:
                    text = await resp.text()
                    log.warning("prefill %s answered %d: %s", url, resp.status, text[:300])
                    return None
                data = await resp.json()
        except (aiohttp.ClientError, asyncio.TimeoutError) as e:
            log.warning("prefill %s failed (%s); the decode server prefills locally", url, e)
            return None
        log.debug("prefill took %.1f ms", (time.perf_counter() - t0) * 1e3)
        return data.get("kv_transfer_params")

    async def handle(self, request: web.Request) -> web.StreamResponse:
        try:
            body = await request.json()
        except json.JSONDecodeError as e:
            return web.json_response({"error": f"request body is not JSON: {e}"}, status=400)
        if not isinstance(body, dict):
            return web.json_response({"error": "request body must be a JSON object"}, status=400)
        headers = {}
        if "X-Request-Id" in request.headers:
            headers["X-Request-Id"] = request.headers["X-Request-Id"]
        params = await self._prefill(request.path, body, headers)
        dreq = dict(body)
        if params:
            dreq["kv_transfer_params"] = params
        else:
            dreq.pop("kv_transfer_params", None)
        url = next(self.decode) + request.path
        try:
            upstream = await self._session().post(url, json=dreq, headers=headers)
        except (aiohttp.ClientError, asyncio.TimeoutError) as e:
            return web.json_response({"error": f"decode server {url} failed: {e}"}, status=502)
        async with upstream:
            if not body.get("stream"):
                return web.Response(
                    body=await upstream.read(),
                    status=upstream.status,
                    content_type=upstream.content_type,
                )
            out = web.StreamResponse(status=upstream.status)
            out.content_type = upstream.content_type
            try:
                await out.prepare(request)
                async for chunk in upstream.content.iter_any():
                    await out.write(chunk)
                await out.write_eof()
            except ConnectionResetError:
                # the client hung up: leaving this block closes the decode connection,
                # so the decode server aborts the request and frees its blocks
                log.info("client of %s hung up mid-stream; decode request aborted", url)
            return out

    async def health(self, request: web.Request) -> web.Response:
        status: dict[str, Any] = {}
        ok = True
        for url in self.prefill_urls + self.decode_urls:
            try:
                async with self._session().get(
                    url + "/health", timeout=aiohttp.ClientTimeout(total=5)
                ) as r:
                    status[url] = r.status
                    ok &= r.status == 200
            except (aiohttp.ClientError, asyncio.TimeoutError) as e:
                status[url] = str(e) or type(e).__name__
                ok = False
        return web.json_response({"healthy": ok, "upstreams": status}, status=200 if ok else 503)


def make_app(prefill: list[str], decode: list[str], timeout: float = 600.0) -> web.Application:
    proxy = Proxy(prefill, decode, timeout)
    app = web.Application(client_max_size=64 << 20)
    app.on_startup.append(proxy.start)
    app.on_cleanup.append(proxy.stop)
    app.router.add_post("/v1/completions", proxy.handle)
    app.router.add_post("/v1/chat/completions", proxy.handle)
    app.router.add_get("/health", proxy.health)
    return app


def main(argv: list[str] | None = None) -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--host", default="127.0.0.1")
    ap.add_argument("--port", type=int, default=8000)
    ap.add_argument(
        "--prefill", action="append", required=True, help="producer base URL (repeatable)"
    )
    ap.add_argument(
        "--decode", action="append", required=True, help="consumer base URL (repeatable)"
    )
    ap.add_argument("--timeout", type=float, default=600.0, help="upstream timeout, seconds")
    ap.add_argument("--log-level", default="INFO")
    a = ap.parse_args(argv)
    logging.basicConfig(level=a.log_level, format="%(asctime)s %(name)s %(levelname)s %(message)s")
    web.run_app(
        make_app(a.prefill, a.decode, a.timeout),
        host=a.host,
        port=a.port,
        print=None,
        handler_cancellation=True,  # a client that hangs up cancels its upstream requests
    )


if __name__ == "__main__":
    main()
