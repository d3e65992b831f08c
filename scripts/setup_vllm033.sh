#!/usr/bin/env bash
# Creates or refreshes the second environment: vLLM 0.33.0's code (the CUDA wheel, --no-deps)
# over CPU torch, for the engine-free scheduler- and worker-level tests (make pytest-vllm033).
# Modules import and schedulers with a KV connector build; engines do not run (no CUDA kernels).
set -euo pipefail
PYTHON=${PYTHON:-python3}
VENV=${VENV:-.venv-vllm033}
TORCH_SPEC=${TORCH_SPEC:-torch==2.13.0+cpu}
VLLM_SPEC=${VLLM_SPEC:-vllm==0.33.0}
# a folder holding the vLLM wheel already (`pip download --no-deps vllm==0.33.0 -d DIR`)
VLLM_WHEEL_DIR=${VLLM_WHEEL_DIR:-/tmp/vllm033-wheel}

if [ ! -x "$VENV/bin/python" ]; then
  echo "[setup-vllm033] creating $VENV"
  "$PYTHON" -m venv "$VENV"
fi
source "$(dirname "$0")/install_cmd.sh"
LINKS=()
if compgen -G "$VLLM_WHEEL_DIR/vllm-*.whl" >/dev/null; then LINKS=(--find-links "$VLLM_WHEEL_DIR"); fi
"${INSTALL[@]}" "$TORCH_SPEC" packaging
"${INSTALL[@]}" --no-deps "${LINKS[@]}" "$VLLM_SPEC"
# vLLM's own requirements less torch's companions and the GPU kernels (they need CUDA or pull
# the CUDA torch); xgrammar without its dependencies (it pulls triton).
REQS="$VENV/vllm-requirements.txt"
"$VENV/bin/python" - "$REQS" <<'PY'
import re
import sys
from importlib.metadata import requires

from packaging.requirements import Requirement

GPU = re.compile(
    r"^(torch|torchvision|torchaudio|torchcodec|triton|flashinfer.*|nvidia-.*|nvtx|pynvvideocodec"
    r"|tilelang|fastsafetensors|instanttensor|quack-kernels|tokenspeed-mla"
    r"|humming-kernels|xgrammar)$"
)
keep = []
for line in requires("vllm") or []:
    req = Requirement(line)
    if req.marker is not None and not req.marker.evaluate({"extra": ""}):
        continue
    if not GPU.match(req.name.lower().replace("_", "-")):
        keep.append(str(req))
with open(sys.argv[1], "w") as out:
    out.write("\n".join(keep) + "\n")
PY
XGRAMMAR=$("$VENV/bin/python" -c "
from importlib.metadata import requires
print(next(r.split(';')[0].replace(' ', '') for r in requires('vllm') if r.startswith('xgrammar')))")
"${INSTALL[@]}" "$TORCH_SPEC" -r "$REQS" -e ".[test]"
"${INSTALL[@]}" --no-deps "$XGRAMMAR"
"${PIP[@]}" uninstall -y -q torchvision torchaudio torchcodec >/dev/null 2>&1 || true
"$VENV/bin/python" -c "
import torch, vllm, vllm_omni_kv
from vllm.v1.core.sched.scheduler import Scheduler
print('[setup-vllm033] torch', torch.__version__, '| vllm', vllm.__version__)"
