"""The demo's processes: start them in their own process groups, wait for health, stop them
all (also on Ctrl-C, SIGTERM or SIGHUP)."""

from __future__ import annotations

import contextlib
import os
import signal
import subprocess
import sys
import time
from collections.abc import Iterator
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import requests


class DemoError(Exception):
    """A failure the user can act on; the message says what to read or do."""


class Terminated(Exception):
    """SIGTERM / SIGHUP: unwind like Ctrl-C so every process is stopped."""


@dataclass
class Service:
    name: str
    proc: subprocess.Popen[bytes]
    log: Path
    url: str

    def tail(self, n: int = 25) -> str:
        try:
            lines = self.log.read_text(errors="replace").splitlines()
        except OSError:
            return "(no log)"
        return "\n".join("    " + x for x in lines[-n:])


def _group_members(pgid: int) -> list[int]:
    """Live (non-zombie) processes of the process group ``pgid``."""
    out = []
    for entry in os.listdir("/proc"):
        if not entry.isdigit():
            continue
        try:
            with open(f"/proc/{entry}/stat") as f:
                stat = f.read()
        except OSError:
            continue
        # pid (comm) state ppid pgrp ...; comm may contain spaces and parentheses
        fields = stat[stat.rfind(")") + 2 :].split()
        if len(fields) > 2 and int(fields[2]) == pgid and fields[0] != "Z":
            out.append(int(entry))
    return out


@dataclass
class Supervisor:
    """Starts processes in their own process groups and always stops the whole group."""

    log_dir: Path
    env: dict[str, str]
    cwd: Path
    services: list[Service] = field(default_factory=list)
    started: list[dict[str, Any]] = field(default_factory=list)

    def start(self, name: str, cmd: list[str], url: str) -> Service:
        self.log_dir.mkdir(parents=True, exist_ok=True)
        log = self.log_dir / f"{name}.log"
        with open(log, "wb") as f:
            f.write(("$ " + " ".join(cmd) + "\n").encode())
            f.flush()
            proc = subprocess.Popen(
                cmd,
                stdin=subprocess.DEVNULL,
                stdout=f,
                stderr=subprocess.STDOUT,
                env=self.env,
                cwd=self.cwd,
                start_new_session=True,
            )
        svc = Service(name, proc, log, url)
        self.services.append(svc)
        self.started.append({"name": name, "pid": proc.pid, "log": str(log)})
        return svc

    def stop(self, svcs: list[Service], grace: float = 20.0) -> None:
        """SIGTERM the groups, wait up to ``grace`` seconds, then SIGKILL what is left.

        A leader is reaped only at the end, so its pid stays its group's id meanwhile.
        """
        svcs = [s for s in svcs if s in self.services]
        for s in svcs:
            with contextlib.suppress(ProcessLookupError):
                os.killpg(s.proc.pid, signal.SIGTERM)
        deadline = time.monotonic() + grace
        while any(_group_members(s.proc.pid) for s in svcs) and time.monotonic() < deadline:
            time.sleep(0.1)
        for s in svcs:
            if _group_members(s.proc.pid):
                # vLLM defers SIGTERM while its engine is still being built
                print(
                    f"  {s.name} did not stop within {grace:.0f}s of SIGTERM: SIGKILL", flush=True
                )
                with contextlib.suppress(ProcessLookupError):
                    os.killpg(s.proc.pid, signal.SIGKILL)
        deadline = time.monotonic() + 10
        while any(_group_members(s.proc.pid) for s in svcs) and time.monotonic() < deadline:
            time.sleep(0.1)
        for s in svcs:
            try:
                s.proc.wait(timeout=5)
            except subprocess.TimeoutExpired:
                print(f"  {s.name} (pid {s.proc.pid}) is still running after SIGKILL", flush=True)
                continue
            self.services.remove(s)

    def stop_all(self, grace: float) -> None:
        """Stop everything still running; Ctrl-C / SIGTERM cannot interrupt this."""
        sigs = (signal.SIGINT, signal.SIGTERM, signal.SIGHUP)
        old = {s: signal.signal(s, signal.SIG_IGN) for s in sigs}
        try:
            self.stop(list(self.services), grace)
        finally:
            with contextlib.suppress(Exception):
                from vllm_omni_kv.backends.shm import arena as shm_arena

                shm_arena.sweep_orphans()  # segments of a server that had to be killed
            for s, h in old.items():
                signal.signal(s, h)


def _healthy(url: str) -> bool:
    try:
        return requests.get(url + "/health", timeout=2).status_code == 200
    except requests.RequestException:
        return False


def wait_healthy(services: list[Service], timeout: float) -> None:
    """Poll ``/health`` of every service, with a spinner line and the elapsed seconds."""
    tty = sys.stdout.isatty()
    frames = "|/-\\"
    start = time.monotonic()
    ready: dict[str, float] = {}
    last_note = 0.0
    tick = 0
    while len(ready) < len(services):
        for s in services:
            if s.name in ready:
                continue
            rc = s.proc.poll()
            if rc is not None:
                if tty:
                    print()
                raise DemoError(
                    f"{s.name} exited with code {rc} before it became healthy; read its log "
                    f"{s.log}. Last lines:\n{s.tail()}"
                )
            if _healthy(s.url):
                ready[s.name] = time.monotonic() - start
        elapsed = time.monotonic() - start
        if elapsed > timeout:
            if tty:
                print()
            slow = [s for s in services if s.name not in ready]
            raise DemoError(
                f"not healthy after {timeout:.0f}s: {', '.join(s.name for s in slow)}; read "
                + ", ".join(str(s.log) for s in slow)
                + " (a busy machine starts slower: raise --timeout)"
            )
        state = "  ".join(
            f"{s.name} {'ok' if s.name in ready else frames[tick % 4]}" for s in services
        )
        if tty:
            print(f"\r  waiting for health: {state}  {elapsed:5.1f}s ", end="", flush=True)
        elif elapsed - last_note >= 10:
            print(f"  waiting for health: {state}  {elapsed:5.1f}s", flush=True)
            last_note = elapsed
        tick += 1
        if len(ready) < len(services):
            time.sleep(0.25)
    took = ", ".join(f"{n} {t:.0f}s" for n, t in ready.items())
    print(
        ("\r" if tty else "")
        + f"  healthy after {time.monotonic() - start:.1f}s ({took})"
        + " " * 20
    )


@contextlib.contextmanager
def terminate_as_interrupt() -> Iterator[None]:
    def handler(signum: int, frame: Any) -> None:
        raise Terminated(signal.Signals(signum).name)

    old = {s: signal.signal(s, handler) for s in (signal.SIGTERM, signal.SIGHUP)}
    # Ctrl-C must stop the servers even where SIGINT was ignored at start (a shell's `&`)
    old[signal.SIGINT] = signal.signal(signal.SIGINT, signal.default_int_handler)
    try:
        yield
    finally:
        for s, h in old.items():
            signal.signal(s, h)
