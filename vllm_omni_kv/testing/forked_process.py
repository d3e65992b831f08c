"""A child of the engine zygote, seen from the parent like :class:`subprocess.Popen`."""

from __future__ import annotations

import contextlib
import os
import signal
import subprocess
import time
from typing import IO, TYPE_CHECKING

if TYPE_CHECKING:
    from vllm_omni_kv.testing.engine_zygote import Zygote


class ForkedProcess:
    """A child of the zygote seen like :class:`subprocess.Popen` (``text`` pipes)."""

    def __init__(self, zygote: Zygote, pid: int, stdin: IO[str] | None, stdout: IO[str] | None):
        self.pid = pid
        self.args = ["engine_zygote", str(pid)]
        self.stdin: IO[str] | None = stdin
        self.stdout: IO[str] | None = stdout
        self.returncode: int | None = None
        self._zygote = zygote

    def poll(self) -> int | None:
        if self.returncode is None:
            self.returncode = self._zygote.exit_code(self.pid)
        return self.returncode

    def wait(self, timeout: float | None = None) -> int:
        deadline = None if timeout is None else time.monotonic() + timeout
        while (code := self.poll()) is None:
            left = 0.5 if deadline is None else deadline - time.monotonic()
            if left <= 0:
                raise subprocess.TimeoutExpired(self.args, timeout or 0.0)
            self._zygote.wait_change(min(left, 0.5))
        return code

    def send_signal(self, sig: int) -> None:
        if self.poll() is None:
            with contextlib.suppress(ProcessLookupError):
                os.kill(self.pid, sig)

    def kill(self) -> None:
        self.send_signal(signal.SIGKILL)

    def terminate(self) -> None:
        self.send_signal(signal.SIGTERM)


def gone(pid: int) -> bool:
    """``pid`` has exited (a zombie nobody reaps counts as exited)."""
    try:
        with open(f"/proc/{pid}/stat") as f:
            return f.read().rsplit(")", 1)[1].split()[0] == "Z"
    except (FileNotFoundError, ProcessLookupError, IndexError):
        return True
