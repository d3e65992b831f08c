#!/usr/bin/env bash
# The GPU check, offline, on a machine with python3 (3.12) and torch + CUDA and neither vLLM
# nor a package registry (the device tool's machine). `make gpu-check` runs it.
#
#   bash scripts/gpu_check.sh site          # install .gpu-wheels into build/gpu-site, check imports
#   bash scripts/gpu_check.sh run RESULTS   # site, then the CUDA tests, the probe, the benchmarks
#
# `site` installs the wheel set `make gpu-wheels` made (scripts/gpu_requirements.txt) with
# `pip install --no-index --target` (or unpacks it where pip is missing) into a folder put on
# PYTHONPATH: nothing is written into the machine's Python. Any failure there stops the check.
# `run` then runs each step under a time limit, goes on after a failed one, writes every
# result into RESULTS (gpu_check.log, gpu_check.json, gpu_tests.xml, gpu_probe.json, the
# benchmarks' JSON) and exits 1 when a step failed. It stops at once on a machine with no
# CUDA device. Environment: GPU_PY, GPU_PY_VERSION, GPU_WHEELS, GPU_SITE, GPU_TESTS.
set -uo pipefail
cd "$(dirname "$0")/.."
ROOT=$PWD
PY=${GPU_PY:-python3}
PY_VERSION=${GPU_PY_VERSION:-3.12}
WHEELS=${GPU_WHEELS:-.gpu-wheels}
SITE=$(realpath -m "${GPU_SITE:-build/gpu-site}")
TESTS=${GPU_TESTS:-tests/connector/test_layout_emulated.py}
IMPORTS="msgpack, xxhash, yaml, safetensors, numpy, pytest, pytest_timeout, xdist, execnet, hypothesis, pygments, requests"

die() {
  echo "gpu-check: $*" >&2
  exit 2
}

site() {
  "$PY" -c "import sys; v = '%d.%d' % sys.version_info[:2]; sys.exit(None if v == '$PY_VERSION' else f'$PY is Python {v}; the wheel set is for $PY_VERSION (set GPU_PY)')" ||
    die "wrong interpreter"
  compgen -G "$WHEELS/*.whl" >/dev/null ||
    die "no wheels in $WHEELS: run 'make gpu-wheels' where the package index is reachable, and carry $WHEELS"
  rm -rf "$SITE" && mkdir -p "$SITE" || die "cannot create $SITE"
  if "$PY" -m pip --version >/dev/null 2>&1; then
    "$PY" -m pip install -q --disable-pip-version-check --no-cache-dir --no-index \
      --find-links "$WHEELS" --target "$SITE" -r scripts/gpu_requirements.txt ||
      die "the wheels in $WHEELS do not install for $PY: rebuild them with 'make gpu-wheels'"
  else
    echo "gpu-check: $PY has no pip; unpacking the wheels into $SITE"
    for w in "$WHEELS"/*.whl; do
      "$PY" -m zipfile -e "$w" "$SITE" || die "cannot unpack $w"
    done
  fi
  PYTHONPATH="$SITE:$ROOT" "$PY" -c "import $IMPORTS, vllm_omni_kv" ||
    die "an import failed with $SITE on PYTHONPATH (see above)"
  echo "gpu-check: $(ls "$WHEELS"/*.whl | wc -l) wheels installed into $SITE"
}

STEPS=()
FAILED=0

# step NAME SECONDS CMD...: run CMD under a time limit and record its exit status and time
step() {
  local name=$1 limit=$2 t0 rc
  shift 2
  echo "=== gpu-check: $name (limit ${limit}s)"
  t0=$(date +%s%N)
  timeout -k 10 "$limit" "$@"
  rc=$?
  [ "$rc" -eq 0 ] || FAILED=1
  STEPS+=("$name $rc $((($(date +%s%N) - t0) / 1000000))")
  echo "=== gpu-check: $name exited $rc"
}

summary() {
  local out=$1
  "$PY" - "$out" "${STEPS[@]}" <<'EOF'
import json, sys, torch
out, rows = sys.argv[1], [r.split() for r in sys.argv[2:]]
steps = [{"step": n, "exit": int(rc), "seconds": int(ms) / 1000} for n, rc, ms in rows]
info = {
    "device": torch.cuda.get_device_name(0),
    "devices": torch.cuda.device_count(),
    "torch": torch.__version__,
    "cuda": torch.version.cuda,
    "python": sys.version.split()[0],
    "steps": steps,
    "ok": all(s["exit"] == 0 for s in steps),
}
with open(f"{out}/gpu_check.json", "w") as f:
    json.dump(info, f, indent=2)
print(json.dumps(info, indent=2))
EOF
}

run() {
  local out=${1:-}
  [ -n "$out" ] || die "name the results folder: make gpu-check GPU_OUT=DIR (default \$OUT)"
  mkdir -p "$out" || die "cannot create $out"
  out=$(realpath "$out")
  exec > >(tee "$out/gpu_check.log") 2>&1
  "$PY" -c "import torch" || die "$PY cannot import torch (set GPU_PY to the python that has it)"
  "$PY" -c "import torch; assert torch.cuda.is_available()" 2>/dev/null ||
    die "gpu-check needs a CUDA device: torch.cuda.is_available() is False for $PY"
  site
  export PYTHONPATH="$SITE:$ROOT"
  local files
  # the listed CUDA tests and every module with a test marked `gpu`
  # shellcheck disable=SC2086  # word splitting of the test list is intended
  files=$( (printf '%s\n' $TESTS; grep -rlE 'pytest\.mark\.gpu' tests --include='*.py') | sort -u)
  # shellcheck disable=SC2086
  step tests 240 env OMNIKV_TEST_DEVICE=cuda "$PY" -m pytest -q -p no:cacheprovider \
    --timeout 120 --junitxml "$out/gpu_tests.xml" $files \
    -k "layout or emulat or accelerator or cuda or gpu"
  step probe 150 "$PY" scripts/gpu_probe.py --out "$out/gpu_probe.json"
  step gpu_copy_bench 60 "$PY" benchmarks/gpu_copy_bench.py --out "$out/gpu_copy_bench.json"
  step region_bench 60 "$PY" benchmarks/region_bench.py --out "$out/region_bench.json"
  summary "$out"
  exit "$FAILED"
}

case "${1:-}" in
  site) site ;;
  run) run "${2:-}" ;;
  *) die "usage: $0 site | run RESULTS_DIR" ;;
esac
