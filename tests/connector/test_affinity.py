"""Placement of the connector's background threads (real threads, real affinity masks)."""

from __future__ import annotations

import os
import subprocess
import sys
import textwrap
import threading
from concurrent.futures import ThreadPoolExecutor

import pytest

from vllm_omni_kv.connector.affinity import (
    apply_to_current_thread,
    background_cpus,
    describe,
    parse_cpu_list,
    spawn_on,
)

pytestmark = pytest.mark.skipif(
    not hasattr(os, "sched_getaffinity") or len(os.sched_getaffinity(0)) < 2,
    reason="needs Linux CPU affinity and at least two CPUs",
)


def test_parse_and_describe_cpu_lists() -> None:
    assert parse_cpu_list("0-3,8, 10") == {0, 1, 2, 3, 8, 10}
    assert describe({0, 1, 2, 3, 8, 10, 11}) == "0-3,8,10-11"
    for bad in ("", "3-1", "a", "-1"):
        with pytest.raises(ValueError):
            parse_cpu_list(bad)


def _new_thread_cpus() -> set[int]:
    """The CPUs a thread started now by the calling thread begins on."""
    seen: dict[str, set[int]] = {}

    def body() -> None:
        seen["cpus"] = os.sched_getaffinity(0)

    t = threading.Thread(target=body)
    t.start()
    t.join()
    return seen["cpus"]


def test_spawn_on_places_new_threads_and_restores_the_caller() -> None:
    """A pinned thread (like vLLM's worker main thread) starts helpers on wider CPUs."""
    everything = os.sched_getaffinity(0)
    first = min(everything)
    out: dict[str, set[int]] = {}

    def pinned_main() -> None:
        os.sched_setaffinity(0, {first})
        inherited = _new_thread_cpus()
        with spawn_on(everything):
            out["spawned"] = _new_thread_cpus()
        out["inherited"] = inherited
        out["caller_after"] = os.sched_getaffinity(0)
        with ThreadPoolExecutor(
            1, initializer=apply_to_current_thread, initargs=(everything,)
        ) as ex:
            out["pool"] = ex.submit(os.sched_getaffinity, 0).result()
        with spawn_on(None):  # "inherit": nothing moves
            out["none"] = _new_thread_cpus()

    t = threading.Thread(target=pinned_main)
    t.start()
    t.join()
    assert out["inherited"] == {first}  # what happens without us: helpers share the pinned core
    assert out["spawned"] == everything
    assert out["caller_after"] == {first}
    assert out["pool"] == everything
    assert out["none"] == {first}


def test_auto_uses_the_parent_process_cpus_in_a_pinned_child() -> None:
    """vLLM pins the worker process's main thread; its parent (the engine core) is not pinned."""
    code = textwrap.dedent(
        """
        import os
        os.sched_setaffinity(0, {min(os.sched_getaffinity(0))})
        from vllm_omni_kv.connector.affinity import background_cpus, describe
        auto = background_cpus("auto")
        print(describe(auto) if auto else "none", background_cpus("inherit"), describe(background_cpus("0")))
        """
    )
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=60)
    assert out.returncode == 0, out.stderr
    auto, inherit, explicit = out.stdout.split()
    assert parse_cpu_list(auto) == os.sched_getaffinity(0)
    assert inherit == "None" and explicit == "0"
    # not pinned at all: nothing to widen
    assert background_cpus("auto") is None
