"""A preloaded interpreter ("zygote") that forks in-process test engines.

Most of an in-process engine's start is importing torch, transformers and vLLM. The
zygote pays that once per parent process: started as ``python -m
vllm_omni_kv.testing.engine_zygote <fd>`` with one end of a ``SOCK_SEQPACKET`` socket
pair, it imports :data:`PRELOAD` (none of this package's modules: the connector is
imported in each engine, after its environment is set) and then, single-threaded, forks
one child per request. A request is JSON ``{"id", "cfg", "env", "cwd"}`` plus two file
descriptors (the child's stdin and stdout); the child sets its process group, stdio,
working directory and environment and runs :func:`engine_proc._serve`, or, when the request
names ``"main": [module, *args]``, that module as ``python -m module args`` would (a test's
``vllm serve``: :func:`spawn_main`). The zygote
answers ``{"hello": ...}`` once after preloading, ``{"forked": pid, "id": id}`` per
request and ``{"exited": pid, "code": code}`` per child it reaps (``code`` as
:attr:`subprocess.Popen.returncode`). EOF on the socket ends it.

Parent side: :func:`spawn` returns a :class:`ForkedProcess` (the parts of
:class:`subprocess.Popen` :class:`EngineProc` and the tests use), or ``None`` where the
engine's environment differs from the zygote's on what imports read
(:data:`IMPORT_ENV_PREFIXES`) or the zygote is unusable: then the caller starts a fresh
process.
"""

from __future__ import annotations

import atexit
import contextlib
import importlib
import json
import os
import select
import socket
import subprocess
import sys
import threading
import time
import traceback
from pathlib import Path
from typing import Any, NoReturn

from vllm_omni_kv.testing.forked_process import ForkedProcess, gone

#: third-party modules an in-process engine of the test models loads (each optional)
PRELOAD = (
    "torch",
    "transformers",
    "tokenizers",
    "vllm",
    "vllm.config",
    "vllm.entrypoints.llm",
    "vllm.engine.arg_utils",
    "vllm.v1.engine.llm_engine",
    "vllm.v1.engine.core",
    "vllm.v1.engine.core_client",
    "vllm.v1.executor.uniproc_executor",
    "vllm.v1.worker.cpu_worker",
    "vllm.v1.worker.cpu_model_runner",
    "vllm.model_executor.model_loader",
    "vllm.model_executor.models.llama",
    "vllm.model_executor.models.gemma3",
    "vllm.distributed.kv_transfer.kv_connector.v1.base",
    "vllm.v1.core.sched.scheduler",
    "vllm.v1.attention.backends.cpu_attn",
    "vllm.model_executor.layers.quantization.compressed_tensors.utils",
    "compressed_tensors",
    "msgpack",
)
#: environment read while :data:`PRELOAD` imports (thread pools, logging, the loader,
#: Hugging Face settings): a forked engine must agree with the zygote on these keys
IMPORT_ENV_PREFIXES = (
    "OMP_",
    "KMP_",
    "MKL_",
    "VLLM_LOGGING",
    "VLLM_CONFIGURE_LOGGING",
    "LD_",
    "PYTHON",
    "TORCH",
    "HF_",
    "TRANSFORMERS_",
)
#: modules of this package the zygote itself may hold (what ``python -m`` imports)
OWN_MODULES = frozenset(
    {
        "vllm_omni_kv",
        "vllm_omni_kv.testing",
        "vllm_omni_kv.testing.engine_proc",
        "vllm_omni_kv.testing.engine_zygote",
        "vllm_omni_kv.testing.forked_process",
    }
)
_RECV_BYTES = 1 << 20
_MODULE = "vllm_omni_kv.testing.engine_zygote"


def import_env(env: dict[str, str]) -> dict[str, str]:
    """The part of ``env`` that importing :data:`PRELOAD` reads."""
    return {k: v for k, v in env.items() if k.startswith(IMPORT_ENV_PREFIXES)}


def forkable(env: dict[str, str], before: dict[str, str], after: dict[str, str]) -> bool:
    """``env`` agrees with a zygote started with ``before`` that holds ``after`` once
    preloaded: on every import-time key, the value it started with, or one the imports
    set where it had none (torch sets ``TORCHINDUCTOR_CACHE_DIR``; a parent that imported
    torch itself has it too)."""
    env, before, after = import_env(env), import_env(before), import_env(after)
    return all(
        env.get(k) == before.get(k) or (k not in before and env.get(k) == after.get(k))
        for k in set(env) | set(before) | set(after)
    )


# -- the zygote ------------------------------------------------------------------------


def _send(sock: socket.socket, obj: dict[str, Any]) -> None:
    sock.send(json.dumps(obj).encode())


def _preload() -> dict[str, Any]:
    """Import :data:`PRELOAD`; what the parent checks before it trusts the zygote."""
    t0 = time.perf_counter()
    failed = []
    for name in PRELOAD:
        try:
            importlib.import_module(name)
        except Exception as e:  # an optional module: the engine imports what it needs
            failed.append(f"{name}: {type(e).__name__}: {e}")
    own = sorted(m for m in sys.modules if m.split(".")[0] == "vllm_omni_kv")
    return {
        "seconds": round(time.perf_counter() - t0, 2),
        "failed": failed,
        "foreign": [m for m in own if m not in OWN_MODULES],
        "threads": len(os.listdir("/proc/self/task")),
        "env": import_env(dict(os.environ)),
    }


def _reap(sock: socket.socket) -> None:
    while True:
        try:
            pid, status = os.waitpid(-1, os.WNOHANG)
        except ChildProcessError:
            return
        if pid == 0:
            return
        _send(sock, {"exited": pid, "code": os.waitstatus_to_exitcode(status)})


def _child(sock: socket.socket, req: dict[str, Any], fds: list[int]) -> NoReturn:
    """The forked engine: never returns into the zygote's loop."""
    code = 1
    try:
        os.setpgid(0, 0)  # its own group (kill_group); the zygote sets it too (no race)
        sock.close()
        os.dup2(fds[0], 0)
        os.dup2(fds[1], 1)
        os.dup2(fds[1], 2)
        for fd in fds:
            os.close(fd)
        os.chdir(req["cwd"])
        os.environ.clear()
        os.environ.update(req["env"])
        _run_request(req)
        code = 0
    except SystemExit as e:
        code = e.code if isinstance(e.code, int) else (0 if e.code is None else 1)
    except BaseException:
        traceback.print_exc()
    with contextlib.suppress(BaseException):
        sys.stdout.flush()
        sys.stderr.flush()
        threading._shutdown()  # type: ignore[attr-defined]  # as interpreter exit does
        atexit._run_exitfuncs()
        sys.stdout.flush()
        sys.stderr.flush()
    os._exit(code)


def _run_request(req: dict[str, Any]) -> None:
    """In the forked child: the engine loop, or the module the request names as its main."""
    if req.get("main"):
        import runpy

        module, *args = req["main"]
        sys.argv = [module, *args]
        sys.path[0] = os.getcwd()  # as `python -m` puts its working directory first
        runpy.run_module(module, run_name="__main__", alter_sys=True)
        return
    from vllm_omni_kv.testing import engine_proc

    sys.argv = [engine_proc.__file__, json.dumps(req["cfg"])]
    engine_proc._serve(req["cfg"])


def _fork(sock: socket.socket, data: bytes, fds: list[int]) -> None:
    req = json.loads(data)
    if len(fds) != 2:
        for fd in fds:
            os.close(fd)
        _send(sock, {"error": f"expected 2 descriptors, got {len(fds)}", "id": req.get("id")})
        return
    sys.stdout.flush()
    sys.stderr.flush()
    pid = os.fork()
    if pid == 0:
        _child(sock, req, fds)
    for fd in fds:
        os.close(fd)
    with contextlib.suppress(OSError):  # already exited, or already its own group
        os.setpgid(pid, pid)
    _send(sock, {"forked": pid, "id": req["id"]})


def serve(fd: int) -> None:
    """The zygote: preload, then fork on request and report exits until EOF."""
    sock = socket.socket(fileno=fd)
    _send(sock, {"hello": _preload()})
    while True:
        ready, _, _ = select.select([sock], [], [], 0.2)
        _reap(sock)
        if not ready:
            continue
        data, fds, _, _ = socket.recv_fds(sock, _RECV_BYTES, 2)
        if not data:
            break
        _fork(sock, data, fds)
    sock.close()


# -- the parent ------------------------------------------------------------------------


class Zygote:
    """Parent end of one zygote process: start it, fork engines, track their exits."""

    def __init__(self, env: dict[str, str], log: Path | None = None):
        self.env = dict(env)
        ours, theirs = socket.socketpair(socket.AF_UNIX, socket.SOCK_SEQPACKET)
        out: Any = open(log, "a") if log else subprocess.DEVNULL  # noqa: SIM115
        try:
            self.proc = subprocess.Popen(
                [sys.executable, "-m", _MODULE, str(theirs.fileno())],
                pass_fds=[theirs.fileno()],
                stdin=subprocess.DEVNULL,
                stdout=out,
                stderr=subprocess.STDOUT,
                env=self.env,
                start_new_session=True,
            )
        finally:
            theirs.close()
            if log:
                out.close()
        self._sock = ours
        self._cv = threading.Condition()
        self._send_lock = threading.Lock()
        self.hello: dict[str, Any] | None = None
        self._forked: dict[int, int] = {}  # request id -> pid
        self._codes: dict[int, int] = {}  # pid -> exit code
        self._alive = True
        self._next_id = 0
        threading.Thread(target=self._read, daemon=True, name="engine-zygote").start()

    def _read(self) -> None:
        while True:
            try:
                data = self._sock.recv(_RECV_BYTES)
            except OSError:
                data = b""
            with self._cv:
                if not data:
                    self._alive = False
                    self._cv.notify_all()
                    return
                msg = json.loads(data)
                if "hello" in msg:
                    self.hello = msg["hello"]
                elif "forked" in msg:
                    self._codes.pop(msg["forked"], None)  # a reused pid
                    self._forked[msg["id"]] = msg["forked"]
                elif "error" in msg:  # a request the zygote refused: no child
                    self._forked[msg["id"]] = -1
                elif "exited" in msg:
                    self._codes[msg["exited"]] = msg["code"]
                self._cv.notify_all()

    def ready(self, timeout: float) -> dict[str, Any] | None:
        """The zygote's hello once preloaded with no module of this package and no thread
        besides the main one; ``None`` if it is not so (or dead)."""
        with self._cv:
            self._cv.wait_for(lambda: self.hello is not None or not self._alive, timeout)
            h = self.hello
        usable = self._alive and h is not None and not h["foreign"] and h["threads"] == 1
        return h if usable else None

    @property
    def alive(self) -> bool:
        """The zygote's socket is open (it has not exited)."""
        return self._alive

    def wait_change(self, timeout: float) -> None:
        with self._cv:
            self._cv.wait(timeout)

    def exit_code(self, pid: int) -> int | None:
        with self._cv:
            if pid in self._codes:
                return self._codes[pid]
            alive = self._alive
        return -1 if not alive and gone(pid) else None

    def fork(self, cfg: dict[str, Any], env: dict[str, str], cwd: str) -> ForkedProcess | None:
        """One engine forked with ``env`` in ``cwd``; ``None`` if the zygote did not answer."""
        child_in, parent_in = os.pipe()
        parent_out, child_out = os.pipe()
        pid = self._request({"cfg": cfg, "env": env, "cwd": cwd}, [child_in, child_out])
        if pid is None:
            os.close(parent_in)
            os.close(parent_out)
            return None
        return ForkedProcess(self, pid, os.fdopen(parent_in, "w"), os.fdopen(parent_out, "r"))

    def fork_main(
        self, main: list[str], env: dict[str, str], cwd: str, output: Path
    ) -> ForkedProcess | None:
        """``python -m main[0] main[1:]`` forked with ``env`` in ``cwd``, its stdin empty and
        its output appended to ``output``; ``None`` if the zygote did not answer."""
        stdin = os.open(os.devnull, os.O_RDONLY)
        out = os.open(output, os.O_WRONLY | os.O_CREAT | os.O_APPEND, 0o644)
        req = {"cfg": {}, "main": main, "env": env, "cwd": cwd}
        pid = self._request(req, [stdin, out])
        if pid is None:
            return None
        proc = ForkedProcess(self, pid, None, None)
        proc.args = ["engine_zygote", *main]
        return proc

    def _request(self, req: dict[str, Any], fds: list[int]) -> int | None:
        """Send one fork request with the child's stdin and stdout (closed here); its pid."""
        with self._send_lock:
            self._next_id += 1
            rid = self._next_id
            data = json.dumps({"id": rid, **req}).encode()
            try:
                socket.send_fds(self._sock, [data], fds)
            except OSError:
                rid = -1
            finally:
                for fd in fds:
                    os.close(fd)
        with self._cv:
            self._cv.wait_for(lambda: rid in self._forked or not self._alive, 60)
            pid = self._forked.pop(rid, None)
        return None if pid is None or pid < 0 else pid

    def close(self, timeout: float = 5.0) -> None:
        """EOF to the zygote (its engines keep running until their stdin closes)."""
        with contextlib.suppress(OSError):
            self._sock.shutdown(socket.SHUT_RDWR)
        self._sock.close()
        try:
            self.proc.wait(timeout=timeout)
        except subprocess.TimeoutExpired:
            self.proc.kill()
            self.proc.wait()


_lock = threading.Lock()
_zygote: Zygote | None = None
#: why the last :func:`spawn` or :func:`spawn_main` of this process returned ``None``
refusal: str | None = None


def _shutdown() -> None:
    if _zygote is not None:
        _zygote.close()


def _usable(env: dict[str, str], zygote_env: dict[str, str], log: Path | None) -> Zygote | None:
    """This process's zygote (started on first use with ``zygote_env``, its output to
    ``log``) if a child with ``env`` may fork from it."""
    global _zygote
    with _lock:
        if _zygote is None:  # one per process; a dead one means fresh processes from then on
            atexit.register(_shutdown)
            _zygote = Zygote(zygote_env, log)
        z = _zygote
    global refusal
    hello = z.ready(timeout=300)
    if hello is None:
        refusal = f"zygote unusable: alive={z.alive}, hello={z.hello}"
        return None
    if not forkable(env, z.env, hello["env"]):
        ours, theirs = import_env(env), import_env(z.env)
        keys = sorted(k for k in set(ours) | set(theirs) if ours.get(k) != theirs.get(k))
        refusal = f"environment differs from the zygote's on {keys}"
        return None
    refusal = None
    return z


def spawn(
    cfg: dict[str, Any],
    env: dict[str, str],
    cwd: str,
    zygote_env: dict[str, str],
    log: Path | None = None,
) -> ForkedProcess | None:
    """Fork an in-process engine from this process's zygote, started on first use with
    ``zygote_env`` (its output to ``log``); ``None`` where ``env`` disagrees with that
    zygote on :data:`IMPORT_ENV_PREFIXES` or it cannot serve (start a fresh process)."""
    z = _usable(env, zygote_env, log)
    return None if z is None else z.fork(cfg, env, cwd)


def spawn_main(
    main: list[str],
    env: dict[str, str],
    cwd: str,
    output: Path,
    zygote_env: dict[str, str],
    log: Path | None = None,
) -> ForkedProcess | None:
    """``python -m main[0] main[1:]`` (a ``vllm serve``) forked from this process's zygote
    as :func:`spawn` forks an engine, its output appended to ``output``; ``None``: start it
    fresh."""
    z = _usable(env, zygote_env, log)
    return None if z is None else z.fork_main(main, env, cwd, output)


if __name__ == "__main__":
    serve(int(sys.argv[1]))
