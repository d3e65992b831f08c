# The README's two commands: `make demo` and `make test`. Both build their own environment.
SHELL := /bin/bash
PYTHON ?= python3
VENV ?= .venv
PY := $(VENV)/bin/python
PIP := $(PY) -m pip
TORCH_SPEC ?= torch==2.13.0+cpu
# The stamp changes whenever the dependency declaration does, so a re-run is a no-op otherwise.
STAMP := $(VENV)/.installed-$(shell cat pyproject.toml scripts/setup_env.sh scripts/install_cmd.sh 2>/dev/null | sha1sum | cut -c1-12)
PYTEST_ARGS ?=
# pytest-xdist workers (tests/conftest.py: whole modules per worker, the longest first,
# one /dev/shm directory per worker); 0 runs the suite in one process
PYTEST_WORKERS ?= 2

.PHONY: env test lint typecheck pytest demo demo-ar bench clean doctor gpu-wheels gpu-site gpu-check bench-load
.PHONY: env-vllm033 pytest-vllm033

env: $(STAMP)

$(STAMP):
	PYTHON=$(PYTHON) VENV=$(VENV) TORCH_SPEC="$(TORCH_SPEC)" bash scripts/setup_env.sh
	rm -f $(VENV)/.installed-*
	touch $@

# The second environment: vLLM 0.33.0's code (its CUDA wheel, --no-deps) over CPU torch, for the
# engine-free scheduler- and worker-level tests (scripts/setup_vllm033.sh; engines do not run).
VLLM033_VENV ?= .venv-vllm033
VLLM033_STAMP := $(VLLM033_VENV)/.installed-$(shell cat pyproject.toml scripts/setup_vllm033.sh scripts/install_cmd.sh 2>/dev/null | sha1sum | cut -c1-12)
# vLLM's scheduler with the connector (sched_harness), both runners' call orders, the
# kv_transfer_params, the worker half's loads, layouts and handoffs; their engine tests
# (marked e2e) skip there (tests/conftest.py); VLLM033_ARGS adds pytest arguments
VLLM033_ARGS ?=
VLLM033_TESTS := tests/connector/test_scheduler_pd.py tests/connector/test_scheduler_hma.py \
  tests/connector/test_kv_transfer_params.py tests/connector/test_runner_sequences.py \
  tests/testing/test_v2_calls.py tests/connector/test_call_orders.py \
  tests/connector/test_sleep_mode.py tests/connector/test_remote_params.py \
  tests/connector/test_compat.py tests/connector/test_config.py tests/connector/test_trust.py \
  tests/connector/test_units.py tests/connector/test_handoff.py \
  tests/connector/test_receive.py tests/connector/test_stream_order.py \
  tests/connector/test_layout_emulated.py tests/connector/test_layout_hybrid.py \
  tests/connector/test_packed_caches.py tests/connector/test_shared_groups.py \
  tests/connector/test_state_layers.py tests/connector/test_prom.py tests/test_supported_vllm.py

env-vllm033: $(VLLM033_STAMP)

$(VLLM033_STAMP):
	PYTHON=$(PYTHON) VENV=$(VLLM033_VENV) TORCH_SPEC="$(TORCH_SPEC)" bash scripts/setup_vllm033.sh
	rm -f $(VLLM033_VENV)/.installed-*
	touch $@

# VLLM_TARGET_DEVICE=cpu: vLLM's CUDA wheel picks its CPU platform on a machine without a GPU
pytest-vllm033: env-vllm033
	VLLM_TARGET_DEVICE=cpu $(VLLM033_VENV)/bin/python -m pytest -n $(PYTEST_WORKERS) \
	  $(VLLM033_ARGS) $(VLLM033_TESTS)

lint: env
	$(VENV)/bin/ruff check vllm_omni_kv tests benchmarks examples
	$(VENV)/bin/ruff format --check vllm_omni_kv tests benchmarks examples
	$(VENV)/bin/lint-imports

typecheck: env
	$(VENV)/bin/mypy
	$(VENV)/bin/mypy benchmarks
	for d in examples/*/; do $(VENV)/bin/mypy "$$d" || exit 1; done

pytest: env
	$(VENV)/bin/python -m pytest -n $(PYTEST_WORKERS) $(PYTEST_ARGS)

# The documentation site (mkdocs.yml, docs/) into build/site; --strict: a broken link fails.
.PHONY: docs
docs: env
	$(VENV)/bin/mkdocs build --strict -d build/site

test: lint typecheck docs pytest pytest-vllm033

doctor: env
	$(VENV)/bin/vllm-omni-kv doctor --selftest

demo: env
	$(PY) examples/disaggregated_prefill/run_demo.py

demo-ar: env
	$(PY) examples/ar_to_diffusion/run_demo.py

bench: env
	$(PY) benchmarks/transfer_bench.py

# GPU check, on a machine with python3 3.12, torch + CUDA and no vLLM or package registry (the
# device tool's machine): `make gpu-wheels && make gpu-check` (docs/gpu.md).
# `make gpu-wheels` (here, with the package index) puts scripts/gpu_requirements.txt and its
# dependencies (and NIXL's CUDA 13 wheel, repacked without nixl_ep), for CPython $(GPU_PY_VERSION)
# on manylinux x86_64, into $(GPU_WHEELS)/ (git-ignored;
# carry it) and checks the set resolves offline. `make gpu-check` installs it with
# `pip install --no-index --target $(GPU_SITE)` onto PYTHONPATH (a failed install or import
# stops it; NIXL, from scripts/gpu_nodeps.txt, is a step of its own), then runs the CUDA tests
# (GPU_TESTS and every test marked `gpu`), scripts/gpu_probe.py, the GPU benchmarks and the NIXL
# tests and benchmarks on cuda, each under a time limit (all within GPU_CHECK_SECONDS), writing JSON into
# $(GPU_OUT) (`make gpu-check GPU_OUT=DIR`; default $$OUT when set).
GPU_PY ?= python3
GPU_PY_VERSION ?= 3.12
GPU_WHEELS ?= .gpu-wheels
GPU_SITE ?= build/gpu-site
GPU_OUT ?= $(if $(OUT),$(OUT),benchmarks/results/gpu)
GPU_TESTS := tests/connector/test_layout_emulated.py tests/kvcache/test_cache_layout.py \
  tests/kvcache/test_paged_blocks.py tests/kvcache/test_device_staging.py tests/wire/test_codec.py \
  tests/backends/cuda_ipc/test_cuda_ipc.py tests/backends/test_conformance.py \
  tests/kvcache/test_move_plan.py tests/kvcache/test_device_moves.py tests/wire/test_linear_digest.py \
  tests/backends/test_pinner.py tests/backends/test_host_pin.py tests/backends/shm/test_registration.py
GPU_ENV = GPU_PY="$(GPU_PY)" GPU_PY_VERSION=$(GPU_PY_VERSION) GPU_WHEELS=$(GPU_WHEELS) \
  GPU_SITE=$(GPU_SITE) GPU_TESTS="$(GPU_TESTS)"

gpu-wheels:
	$(PYTHON) scripts/gpu_wheels.py ensure --dest $(GPU_WHEELS) --python-version $(GPU_PY_VERSION)

gpu-site:
	$(GPU_ENV) bash scripts/gpu_check.sh site

gpu-check:
	$(GPU_ENV) bash scripts/gpu_check.sh run "$(GPU_OUT)"

clean:
	rm -rf $(VENV) $(VLLM033_VENV) build *.egg-info .pytest_cache .mypy_cache .ruff_cache

# P/D under load (benchmarks/pd_load.py): vLLM's own benchmark client through the proxy for
# colocated, OmniKV shared memory / Mooncake, ExampleConnector and NixlConnector (nixl comes
# with `make env`; without it the JSON records why NIXL did not run).
bench-load: env
	$(PY) benchmarks/pd_load.py
