"""One vLLM ``LLM`` engine in its own process, driven by JSON lines (no pickle).

Used by the end-to-end tests and ``benchmarks/pd_bench.py``. Started as
``python -m vllm_omni_kv.testing.engine_proc '<json config>'``; answers on
stdout with lines prefixed by :data:`MARK` (vLLM's own logging goes there too).
The config holds ``model`` and optional ``LLM`` settings (:data:`LLM_KEYS`)
plus ``kv_transfer_config``; ``"in_process": true`` runs the engine core and its worker
in this one process (vLLM's ``InprocClient`` and ``uni`` executor, TP 1 only: one
interpreter start instead of three). Commands: ``{"cmd": "generate", "prompts":
[[token ids]...], "max_tokens": n, "kv_transfer_params": [dict|None...],
"logprobs": k, "cache_salt": s}``, ``{"cmd": "abort_while_loading", "prompt": [token ids],
"kv_transfer_params": dict}`` (in-process engines: :func:`_abort_while_loading`),
``{"cmd": "sleep", "prompt": [token ids] | None, "kv_transfer_params": dict | None}``
(in-process engines: :func:`_sleep`) and ``{"cmd": "exit"}``; with ``logprobs`` each output carries ``top2``, the two highest
logprobs per generated token; ``cache_salt`` keeps the prompts' cached blocks apart from
those of prompts with another salt (vLLM's prefix-cache salt).
"""

from __future__ import annotations

import contextlib
import json
import os
import signal
import subprocess
import sys
import threading
import time
from collections import deque
from pathlib import Path
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    from vllm_omni_kv.testing.forked_process import ForkedProcess

MARK = "@@OMNIKV@@ "


def kill_group(pid: int, sig: int = signal.SIGKILL) -> None:
    """Signal a whole process group (an engine and its children); gone already is fine."""
    with contextlib.suppress(ProcessLookupError):
        os.killpg(pid, sig)


def _emit(obj: dict[str, Any]) -> None:
    sys.stdout.write(MARK + json.dumps(obj) + "\n")
    sys.stdout.flush()


#: ``LLM`` settings a config may carry, with their defaults
LLM_KEYS: dict[str, Any] = {
    "dtype": "float32",
    "max_model_len": 2048,
    "block_size": 32,
    "max_num_seqs": 32,
    "max_num_batched_tokens": 8192,
    "enable_prefix_caching": None,  # vLLM's default
    "tensor_parallel_size": 1,
    "num_gpu_blocks_override": None,  # a small KV cache (leak checks fill all of it)
    "disable_hybrid_kv_cache_manager": None,  # vLLM's default (HMA on where it applies)
    "mamba_ssm_cache_dtype": None,  # state layers' SSM state dtype (vLLM's default: "auto")
}


def top2_logprobs(logprobs: Any) -> list[list[float]]:
    """Per generated token: the two highest logprobs (how close each greedy choice was)."""
    out = []
    for step in logprobs or []:
        best = sorted((lp.logprob for lp in step.values()), reverse=True)[:2]
        out.append(best + [float("-inf")] * (2 - len(best)))
    return out


def _serve(cfg: dict[str, Any]) -> None:
    from vllm import LLM, SamplingParams
    from vllm.config import KVTransferConfig

    ktc = cfg.get("kv_transfer_config")
    settings = {k: cfg.get(k, v) for k, v in LLM_KEYS.items()}
    settings = {k: v for k, v in settings.items() if v is not None}
    if settings["tensor_parallel_size"] > 1:
        settings["distributed_executor_backend"] = "mp"
    elif cfg.get("in_process"):
        settings["distributed_executor_backend"] = "uni"
    llm = LLM(
        model=cfg["model"],
        enforce_eager=True,
        seed=0,
        kv_transfer_config=KVTransferConfig(**ktc) if ktc else None,
        **settings,
    )
    _emit({"ready": True, "pid": os.getpid()})
    for line in sys.stdin:
        req = json.loads(line)
        if req.get("cmd") == "exit":
            break
        if req.get("cmd") == "abort_while_loading":
            _emit(_abort_while_loading(llm, req, SamplingParams))
            continue
        if req.get("cmd") == "sleep":
            _emit(_sleep(llm, req, SamplingParams))
            continue
        _emit(_generate(llm, req, SamplingParams))


def _abort_while_loading(llm: Any, req: dict[str, Any], sampling_params: Any) -> dict[str, Any]:
    """Add one request with ``kv_transfer_params``, step until vLLM's scheduler has it
    waiting for its remote KV, abort it as a client hang-up does, then step until the
    engine holds no request: the block pool's free blocks before, while it waited and
    after (an in-process engine: the scheduler lives in this process)."""
    from vllm.v1.request import RequestStatus

    engine = llm.llm_engine
    sched = engine.engine_core.engine_core.scheduler
    pool = sched.kv_cache_manager.block_pool
    out: dict[str, Any] = {"free_before": pool.get_num_free_blocks()}
    sp = sampling_params(
        temperature=0,
        max_tokens=16,
        ignore_eos=True,
        extra_args={"kv_transfer_params": dict(req["kv_transfer_params"])},
    )
    rid = f"abort-while-loading-{time.time_ns()}"
    engine.add_request(rid, {"prompt_token_ids": req["prompt"]}, sp)
    deadline = time.monotonic() + 30
    waiting = False
    while not waiting and time.monotonic() < deadline:
        engine.step()
        waiting = any(
            r.status == RequestStatus.WAITING_FOR_REMOTE_KVS for r in sched.requests.values()
        )
    out["free_while_waiting"] = pool.get_num_free_blocks() if waiting else None
    aborted = time.monotonic()
    engine.abort_request([rid])
    while (sched.requests or engine.has_unfinished_requests()) and time.monotonic() < deadline:
        engine.step()
    out["seconds_to_free"] = time.monotonic() - aborted
    out["requests_left"] = len(sched.requests)
    out["free_after"] = pool.get_num_free_blocks()
    return out


def _sleep(llm: Any, req: dict[str, Any], sampling_params: Any) -> dict[str, Any]:
    """vLLM 0.33's sleep and wake-up of the KV cache, as far as the connector sees them
    (vLLM 0.32's CPU engine cannot sleep): ``unregister_kv_caches``, the cache overwritten
    (sleep discards it), ``restore_kv_caches``. With ``prompt``, first add that request
    with ``kv_transfer_params`` and step until it waits for its remote KV (its load in
    flight), then after the wake-up step until it finishes: its tokens and
    ``kv_transfer_params``. Then the prefix cache is cleared, as sleep clears it
    (``prefix_cache_reset``). ``unregister_s``: how long ``unregister_kv_caches`` took."""
    from vllm.distributed.kv_transfer import get_kv_transfer_group
    from vllm.v1.request import RequestStatus

    engine = llm.llm_engine
    sched = engine.engine_core.engine_core.scheduler
    connector = get_kv_transfer_group()  # the worker's (in this process: uni executor)
    rid = f"sleep-{time.time_ns()}"
    if req.get("prompt"):
        extra = {"kv_transfer_params": dict(req["kv_transfer_params"])}
        sp = sampling_params(temperature=0, max_tokens=16, ignore_eos=True, extra_args=extra)
        engine.add_request(rid, {"prompt_token_ids": req["prompt"]}, sp)
        deadline = time.monotonic() + 30
        while time.monotonic() < deadline and not any(
            r.status == RequestStatus.WAITING_FOR_REMOTE_KVS for r in sched.requests.values()
        ):
            engine.step()
    t0 = time.monotonic()
    connector.unregister_kv_caches()
    out: dict[str, Any] = {"unregister_s": time.monotonic() - t0}
    for layer in connector.worker_half.layers:
        layer.cache.copy_(_garbage(layer.cache))
    connector.restore_kv_caches()
    deadline = time.monotonic() + 60
    while (sched.requests or engine.has_unfinished_requests()) and time.monotonic() < deadline:
        for o in engine.step():  # also hands back blocks the voided payloads held
            if o.finished and o.request_id == rid:
                out["token_ids"] = list(o.outputs[0].token_ids)
                out["kv_transfer_params"] = o.kv_transfer_params
    # sleep clears the prefix cache (vLLM's pause before it): no block cached from before
    # the overwrite may be hit
    out["prefix_cache_reset"] = llm.reset_prefix_cache()
    return out


def _garbage(like: Any) -> Any:
    """Random values shaped and typed as tensor ``like`` (what a discarded cache holds)."""
    import torch

    return torch.randn(like.shape, generator=torch.Generator().manual_seed(5)).to(like.dtype)


def _generate(llm: Any, req: dict[str, Any], sampling_params: Any) -> dict[str, Any]:
    """One ``generate`` request of the driver: its outputs, or the error it raised."""
    params = req.get("kv_transfer_params") or [None] * len(req["prompts"])
    sps = [
        sampling_params(
            temperature=0,
            max_tokens=req.get("max_tokens", 16),
            ignore_eos=True,
            logprobs=req.get("logprobs"),
            extra_args={"kv_transfer_params": dict(p)} if p else None,
        )
        for p in params
    ]
    salt = {"cache_salt": str(req["cache_salt"])} if req.get("cache_salt") else {}
    prompts: Any = [{"prompt_token_ids": ids, **salt} for ids in req["prompts"]]
    t0 = time.perf_counter()
    try:
        outs = llm.generate(prompts, sps, use_tqdm=False)
    except Exception as e:  # report, keep serving
        return {"error": f"{type(e).__name__}: {e}", "seconds": time.perf_counter() - t0}
    return {
        "seconds": time.perf_counter() - t0,
        "outputs": [
            {
                "request_id": o.request_id,
                "token_ids": list(o.outputs[0].token_ids),
                "finish_reason": o.outputs[0].finish_reason,
                "kv_transfer_params": o.kv_transfer_params,
                "num_cached_tokens": o.num_cached_tokens,
                **({"top2": top2_logprobs(o.outputs[0].logprobs)} if req.get("logprobs") else {}),
            }
            for o in outs
        ],
    }


def engine_env(cfg: dict[str, Any], env: dict[str, str] | None = None) -> dict[str, str]:
    """The environment of an engine of ``cfg``: this process's, the engine defaults, ``env``."""
    full_env = dict(os.environ)
    full_env.setdefault("VLLM_CPU_KVCACHE_SPACE", "1")
    full_env.setdefault("VLLM_LOGGING_LEVEL", "INFO")
    if cfg.get("in_process"):
        if cfg.get("tensor_parallel_size", 1) > 1:
            raise ValueError("in_process needs tensor_parallel_size 1")
        full_env["VLLM_ENABLE_V1_MULTIPROCESSING"] = "0"
        # one torch thread, as vLLM's CPU worker process sets for itself
        full_env.setdefault("OMP_NUM_THREADS", "1")
    full_env.update(env or {})
    return full_env


class EngineProc:
    """Parent-side handle: start, talk to and stop one engine process. ``preloaded``: an
    in-process engine is forked from this process's preloaded interpreter
    (:mod:`engine_zygote`: no torch / vLLM import per engine) where its environment
    allows, else started fresh."""

    def __init__(
        self,
        cfg: dict[str, Any],
        env: dict[str, str] | None = None,
        log: Path | None = None,
        preloaded: bool = False,
    ):
        full_env = engine_env(cfg, env)
        self.log_lines: deque[str] = deque(maxlen=4000)
        self.log_path = log
        self._log_file = open(log, "a") if log else None  # noqa: SIM115
        self._log_lock = threading.Lock()
        forked = self._fork(cfg, full_env, log) if preloaded and cfg.get("in_process") else None
        #: forked from the zygote, or started fresh
        self.forked = forked is not None
        #: why it was not forked (``None``: forked, or not asked to be)
        self.fresh_because: str | None = None
        if preloaded and cfg.get("in_process") and forked is None:
            from vllm_omni_kv.testing import engine_zygote

            self.fresh_because = engine_zygote.refusal or "the zygote did not answer the fork"
        self.proc: subprocess.Popen[str] | ForkedProcess = forked or self._popen(cfg, full_env)
        self._replies: deque[dict[str, Any]] = deque()
        self._cv = threading.Condition()
        self._reader = threading.Thread(target=self._read, daemon=True)
        self._reader.start()

    @staticmethod
    def _fork(cfg: dict[str, Any], env: dict[str, str], log: Path | None) -> ForkedProcess | None:
        from vllm_omni_kv.testing import engine_zygote

        zygote_log = log.parent / f"zygote-{os.getpid()}.log" if log else None
        zygote_env = engine_env({"in_process": True})
        return engine_zygote.spawn(cfg, env, os.getcwd(), zygote_env, zygote_log)

    @staticmethod
    def _popen(cfg: dict[str, Any], env: dict[str, str]) -> subprocess.Popen[str]:
        return subprocess.Popen(
            [sys.executable, "-m", "vllm_omni_kv.testing.engine_proc", json.dumps(cfg)],
            stdin=subprocess.PIPE,
            stdout=subprocess.PIPE,
            stderr=subprocess.STDOUT,
            text=True,
            env=env,
            start_new_session=True,
        )

    def _read(self) -> None:
        assert self.proc.stdout is not None
        for line in self.proc.stdout:
            if line.startswith(MARK):
                with self._cv:
                    self._replies.append(json.loads(line[len(MARK) :]))
                    self._cv.notify_all()
            else:
                self.log_lines.append(line.rstrip("\n"))
                with self._log_lock:  # stop() may be closing it
                    if self._log_file:
                        self._log_file.write(line)
                        self._log_file.flush()
        with self._cv:
            self._cv.notify_all()

    def _wait_reply(self, timeout: float) -> dict[str, Any]:
        deadline = time.monotonic() + timeout
        with self._cv:
            while not self._replies:
                left = deadline - time.monotonic()
                if left <= 0:
                    raise TimeoutError(f"engine gave no reply in {timeout:.0f}s\n{self.tail()}")
                if self.proc.poll() is not None and not self._reader.is_alive():
                    raise RuntimeError(f"engine exited with {self.proc.returncode}\n{self.tail()}")
                self._cv.wait(min(left, 0.5))
            return self._replies.popleft()

    def tail(self, n: int = 60) -> str:
        return "\n".join(list(self.log_lines)[-n:])

    def wait_ready(self, timeout: float = 240.0) -> EngineProc:
        reply = self._wait_reply(timeout)
        if not reply.get("ready"):
            raise RuntimeError(f"unexpected first reply {reply}")
        return self

    def generate(
        self,
        prompts: list[list[int]],
        max_tokens: int = 16,
        kv_transfer_params: list[dict[str, Any] | None] | None = None,
        timeout: float = 180.0,
        logprobs: int | None = None,
        cache_salt: str | None = None,
    ) -> dict[str, Any]:
        assert self.proc.stdin is not None
        msg: dict[str, Any] = {"cmd": "generate", "prompts": prompts, "max_tokens": max_tokens}
        if cache_salt:
            msg["cache_salt"] = cache_salt
        if kv_transfer_params is not None:
            msg["kv_transfer_params"] = kv_transfer_params
        if logprobs is not None:
            msg["logprobs"] = logprobs
        self.proc.stdin.write(json.dumps(msg) + "\n")
        self.proc.stdin.flush()
        return self._wait_reply(timeout)

    def abort_while_loading(
        self, prompt: list[int], kv_transfer_params: dict[str, Any], timeout: float = 60.0
    ) -> dict[str, Any]:
        """The engine's block pool around a request aborted while it waits for its remote
        KV (``free_before``, ``free_while_waiting``, ``free_after``, ``requests_left``,
        ``seconds_to_free``: from the abort until the engine held no request)."""
        assert self.proc.stdin is not None
        msg = {"cmd": "abort_while_loading", "prompt": prompt}
        self.proc.stdin.write(json.dumps({**msg, "kv_transfer_params": kv_transfer_params}) + "\n")
        self.proc.stdin.flush()
        return self._wait_reply(timeout)

    def sleep(
        self,
        prompt: list[int] | None = None,
        kv_transfer_params: dict[str, Any] | None = None,
        timeout: float = 120.0,
    ) -> dict[str, Any]:
        """The KV cache put to sleep and woken (in-process engines: ``_sleep``), with
        ``prompt``'s load in flight when one is given."""
        assert self.proc.stdin is not None
        msg = {"cmd": "sleep", "prompt": prompt, "kv_transfer_params": kv_transfer_params}
        self.proc.stdin.write(json.dumps(msg) + "\n")
        self.proc.stdin.flush()
        return self._wait_reply(timeout)

    def kill(self) -> None:
        """SIGKILL the whole process group (the engine core is a child process)."""
        if self.proc.poll() is None:
            kill_group(self.proc.pid)
        self.proc.wait(timeout=30)

    def request_stop(self) -> None:
        """Ask the engine to exit and return at once (:meth:`stop` waits for it): engines
        asked together shut down in parallel."""
        stdin = self.proc.stdin
        if self.proc.poll() is None and stdin is not None and not stdin.closed:
            try:
                stdin.write(json.dumps({"cmd": "exit"}) + "\n")
                stdin.flush()
                stdin.close()
            except (BrokenPipeError, OSError):
                pass

    def stop(self, timeout: float = 60.0) -> None:
        if self.proc.poll() is None:
            self.request_stop()
            try:
                self.proc.wait(timeout=timeout)
            except subprocess.TimeoutExpired:
                kill_group(self.proc.pid, signal.SIGTERM)
                try:
                    self.proc.wait(timeout=15)
                except subprocess.TimeoutExpired:
                    self.kill()
        else:  # reap stray children of a crashed engine
            kill_group(self.proc.pid)
        self._reader.join(timeout=10)  # the rest of its output, up to EOF
        with self._log_lock:
            if self._log_file:
                self._log_file.close()
                self._log_file = None


if __name__ == "__main__":
    _serve(json.loads(sys.argv[1]))
