#!/usr/bin/env bash
# The GPU check, offline, on a machine with python3 (3.12) and torch + CUDA and neither vLLM
# nor a package registry (the device tool's machine). `make gpu-check` runs it.
#
#   bash scripts/gpu_check.sh site          # install .gpu-wheels into build/gpu-site, check imports
#   bash scripts/gpu_check.sh run RESULTS   # site, then the CUDA tests, the probe, the benchmarks
#
# `site` installs the wheel set `make gpu-wheels` made (scripts/gpu_requirements.txt, then
# scripts/gpu_nodeps.txt with --no-deps: NIXL) with `pip install --no-index --target` (or
# unpacks it where pip is missing) into a folder put on PYTHONPATH: nothing is written into
# the machine's Python. A failure there stops the check, except NIXL's: its install and
# import become the failed step `nixl_import`, and the NIXL steps are then skipped.
# `run` then runs each step under a time limit, all of them within GPU_CHECK_SECONDS (default
# 540) from its start, goes on after a failed one, writes every result into RESULTS
# (gpu_check.log, gpu_check.json, gpu_tests.xml, gpu_nixl_tests.xml, gpu_probe.json, the
# benchmarks' JSON) and exits 1 when a step failed or was skipped. It stops at once on a
# machine with no CUDA device. Environment: GPU_PY, GPU_PY_VERSION, GPU_WHEELS, GPU_SITE,
# GPU_TESTS, GPU_CHECK_SECONDS, GPU_STEPS (an extended regex of step names: only those run,
# the others are recorded as deselected; e.g. GPU_STEPS='nixl.*' to rerun NIXL's steps).
set -uo pipefail
cd "$(dirname "${BASH_SOURCE[0]}")/.."
ROOT=$PWD
PY=${GPU_PY:-python3}
PY_VERSION=${GPU_PY_VERSION:-3.12}
WHEELS=${GPU_WHEELS:-.gpu-wheels}
SITE=$(realpath -m "${GPU_SITE:-build/gpu-site}")
TESTS=${GPU_TESTS:-tests/connector/test_layout_emulated.py}
IMPORTS="msgpack, xxhash, yaml, safetensors, numpy, pytest, pytest_timeout, xdist, execnet, hypothesis, pygments, requests"
# imported apart: a failure is the failed step nixl_import, not a dead check
NIXL_IMPORT="import nixl, nixl_cu13; from vllm_omni_kv.backends.nixl.loader import import_nixl; import_nixl(); print('nixl', nixl.__file__)"
NIXL_SITE=0  # 1 once scripts/gpu_nodeps.txt installed
# the UCX transports of the second NIXL benchmark runs (the first: UCX_TLS unset)
NIXL_TLS=${GPU_NIXL_TLS:-cuda_ipc,cuda_copy,tcp}

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
    if "$PY" -m pip install -q --disable-pip-version-check --no-cache-dir --no-index --no-deps \
      --find-links "$WHEELS" --target "$SITE" -r scripts/gpu_nodeps.txt; then
      NIXL_SITE=1
    else
      echo "gpu-check: scripts/gpu_nodeps.txt (NIXL) did not install; its steps will fail" >&2
    fi
  else
    echo "gpu-check: $PY has no pip; unpacking the wheels into $SITE"
    for w in "$WHEELS"/*.whl; do
      "$PY" -m zipfile -e "$w" "$SITE" || die "cannot unpack $w"
    done
    NIXL_SITE=1
  fi
  PYTHONPATH="$SITE:$ROOT" "$PY" -c "import $IMPORTS, vllm_omni_kv" ||
    die "an import failed with $SITE on PYTHONPATH (see above)"
  PYTHONPATH="$SITE:$ROOT" "$PY" -c "$NIXL_IMPORT" ||
    echo "gpu-check: NIXL does not import with $SITE on PYTHONPATH (see above)" >&2
  echo "gpu-check: $(ls "$WHEELS"/*.whl | wc -l) wheels installed into $SITE"
}

STEPS=()
FAILED=0
DEADLINE=0  # set by run: no step runs past it
LAST_RC=  # the last step's exit status ("skipped" when it did not run)

# skip NAME WHY: record a step that did not run (it counts as failed)
skip() {
  echo "=== gpu-check: $1 skipped: $2"
  STEPS+=("$1 skipped 0")
  LAST_RC=skipped
  FAILED=1
}

# step NAME SECONDS CMD...: run CMD under a time limit (cut to what is left before DEADLINE,
# 15 s kept for the summary) and record its exit status and time
step() {
  local name=$1 limit=$2 t0 rc left
  shift 2
  if [ -n "${GPU_STEPS:-}" ] && ! [[ $name =~ ^($GPU_STEPS)$ ]]; then
    echo "=== gpu-check: $name not selected (GPU_STEPS)"
    STEPS+=("$name deselected 0")
    LAST_RC=0
    return
  fi
  left=$((DEADLINE - $(date +%s) - 15))
  [ "$left" -ge 10 ] || { skip "$name" "out of time (GPU_CHECK_SECONDS)"; return; }
  [ "$limit" -le "$left" ] || limit=$left
  echo "=== gpu-check: $name (limit ${limit}s)"
  t0=$(date +%s%N)
  timeout -k 10 "$limit" "$@"
  rc=$?
  LAST_RC=$rc
  [ "$rc" -eq 0 ] || FAILED=1
  STEPS+=("$name $rc $((($(date +%s%N) - t0) / 1000000))")
  echo "=== gpu-check: $name exited $rc"
}

summary() {
  local out=$1
  "$PY" - "$out" "${STEPS[@]}" <<'EOF'
import json, sys, torch
out, rows = sys.argv[1], [r.split() for r in sys.argv[2:]]
steps = [
    {"step": n, "exit": int(rc) if rc.isdigit() else None, "seconds": int(ms) / 1000}
    | ({} if rc.isdigit() else {rc: True})
    for n, rc, ms in rows
]
info = {
    "device": torch.cuda.get_device_name(0),
    "devices": torch.cuda.device_count(),
    "torch": torch.__version__,
    "cuda": torch.version.cuda,
    "python": sys.version.split()[0],
    "steps": steps,
    "ok": all(s["exit"] == 0 for s in steps if not s.get("deselected")),
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
  DEADLINE=$(($(date +%s) + ${GPU_CHECK_SECONDS:-540}))
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
  # (NIXL's tests run in their own step, below)
  # -v: each test's name is written before it runs, so a step cut at its limit shows where
  step tests 200 env OMNIKV_TEST_DEVICE=cuda "$PY" -m pytest -v -p no:cacheprovider \
    --timeout 120 --junitxml "$out/gpu_tests.xml" $files \
    -k "layout or emulat or accelerator or cuda or gpu" -m "not nixl"
  nixl_steps "$out"
  step gpu_copy_bench 60 "$PY" benchmarks/gpu_copy_bench.py --out "$out/gpu_copy_bench.json"
  step region_bench 60 "$PY" benchmarks/region_bench.py --out "$out/region_bench.json"
  step probe 120 "$PY" scripts/gpu_probe.py --out "$out/gpu_probe.json"
  summary "$out"
  exit "$FAILED"
}

# NIXL (nixl-cu13, VRAM): device pools and register_cache of CUDA caches, tested, then
# measured with UCX_TLS unset and set to NIXL_TLS (device pools: nixl_direction auto, so the
# sender WRITEs; register_cache: READ, and the sender's WRITE in region_bench_nixl_write)
nixl_steps() {
  local out=$1 names="nixl_tests nixl_bench nixl_bench_tls region_bench_nixl region_bench_nixl_tls region_bench_nixl_write" n
  if [ "$NIXL_SITE" -ne 1 ]; then
    skip nixl_import "scripts/gpu_nodeps.txt did not install"
  else
    step nixl_import 60 "$PY" -c "$NIXL_IMPORT"
  fi
  if [ "$LAST_RC" != 0 ]; then
    for n in $names; do skip "$n" "NIXL does not import (step nixl_import)"; done
    return
  fi
  step nixl_tests 150 env OMNIKV_TEST_DEVICE=cuda "$PY" -m pytest -v -p no:cacheprovider \
    --timeout 60 --junitxml "$out/gpu_nixl_tests.xml" -m nixl -k "cuda or page_reads" \
    tests/backends/nixl/test_nixl_cuda.py tests/backends/test_conformance.py \
    tests/backends/pull/test_page_reads.py
  local bench=(benchmarks/nixl_bench.py --device cuda --sizes 16 64 --repeats 3 --out "$out")
  step nixl_bench 60 env -u UCX_TLS "$PY" "${bench[@]}" --name nixl_bench_cuda
  step nixl_bench_tls 60 env UCX_TLS="$NIXL_TLS" "$PY" "${bench[@]}" --name nixl_bench_cuda_tls
  local region=(benchmarks/region_bench.py --backend nixl_cache --device cuda --sizes 16 64)
  step region_bench_nixl 60 env -u UCX_TLS "$PY" "${region[@]}" \
    --out "$out/region_bench_nixl.json"
  step region_bench_nixl_tls 60 env UCX_TLS="$NIXL_TLS" "$PY" "${region[@]}" \
    --out "$out/region_bench_nixl_tls.json"
  # the producer WRITEs into the consumer's cache (nixl_bench's device pools do by default)
  step region_bench_nixl_write 60 env -u UCX_TLS "$PY" benchmarks/region_bench.py \
    --backend nixl_cache_write --device cuda --sizes 16 64 --out "$out/region_bench_nixl_write.json"
}

# sourced (tests/test_gpu_check.py): the functions only
[ "${BASH_SOURCE[0]}" = "$0" ] || return 0
case "${1:-}" in
  site) site ;;
  run) run "${2:-}" ;;
  *) die "usage: $0 site | run RESULTS_DIR" ;;
esac
