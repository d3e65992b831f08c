# The README's two commands: `make demo` and `make test`. Both build their own environment.
SHELL := /bin/bash
PYTHON ?= python3
VENV ?= .venv
PY := $(VENV)/bin/python
PIP := $(PY) -m pip
TORCH_SPEC ?= torch==2.13.0+cpu
# The stamp changes whenever the dependency declaration does, so a re-run is a no-op otherwise.
STAMP := $(VENV)/.installed-$(shell cat pyproject.toml scripts/setup_env.sh 2>/dev/null | sha1sum | cut -c1-12)
PYTEST_ARGS ?=
# pytest-xdist workers (tests/conftest.py: whole modules per worker, the longest first,
# one /dev/shm directory per worker); 0 runs the suite in one process
PYTEST_WORKERS ?= 2

.PHONY: env test lint typecheck pytest demo demo-ar bench clean doctor gpu-wheels gpu-check bench-load

env: $(STAMP)

$(STAMP):
	PYTHON=$(PYTHON) VENV=$(VENV) TORCH_SPEC="$(TORCH_SPEC)" bash scripts/setup_env.sh
	rm -f $(VENV)/.installed-*
	touch $@

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

test: lint typecheck docs pytest

doctor: env
	$(VENV)/bin/vllm-omni-kv doctor --selftest

demo: env
	$(PY) examples/disaggregated_prefill/run_demo.py

demo-ar: env
	$(PY) examples/ar_to_diffusion/run_demo.py

bench: env
	$(PY) benchmarks/transfer_bench.py

# GPU check, on a machine with torch + CUDA and no vLLM or package registry (the device
# tool's machine): the layout emulator suite and the transfer core's CUDA tests on `cuda`.
# `make gpu-wheels` (here, with a registry) puts the dependencies that machine may lack in
# $(GPU_WHEELS)/ (git-ignored; carry it) for GPU_PY_VERSIONS; numpy is expected with torch.
# `make gpu-check` installs them from there and runs the tests with the machine's python3.
GPU_PY ?= python3
GPU_WHEELS ?= .gpu-wheels
GPU_PY_VERSIONS ?= 3.10 3.11 3.12 3.13
# where gpu-check writes the GPU benchmark's JSON (on the device tool: its $OUT folder)
GPU_OUT ?= $(if $(OUT),$(OUT),benchmarks/results)
GPU_DEPS := msgpack xxhash pyzmq pyyaml safetensors pytest pytest-timeout pluggy iniconfig packaging hypothesis attrs sortedcontainers
GPU_TESTS := tests/connector/test_layout_emulated.py tests/kvcache/test_cache_layout.py \
  tests/kvcache/test_device_staging.py tests/wire/test_codec.py tests/backends/cuda_ipc/test_cuda_ipc.py \
  tests/backends/test_conformance.py

gpu-wheels: env
	for v in $(GPU_PY_VERSIONS); do \
	  $(PIP) download -q --only-binary=:all: --no-deps --python-version $$v \
	    --platform manylinux2014_x86_64 --platform manylinux_2_17_x86_64 \
	    --platform manylinux_2_28_x86_64 -d $(GPU_WHEELS) $(GPU_DEPS) || exit 1; \
	done

gpu-check:
	$(GPU_PY) -c "import torch; assert torch.cuda.is_available(), 'gpu-check needs a CUDA device'"
	-$(GPU_PY) -m pip install -q --no-index --find-links $(GPU_WHEELS) $(GPU_DEPS)
	$(GPU_PY) -c "import msgpack, xxhash, zmq, yaml, safetensors, numpy, pytest, hypothesis"
	OMNIKV_TEST_DEVICE=cuda PYTHONPATH=$(CURDIR) $(GPU_PY) -m pytest -q -p no:cacheprovider \
	  $(GPU_TESTS) -k "layout or emulat or accelerator or cuda"
	PYTHONPATH=$(CURDIR) $(GPU_PY) benchmarks/gpu_copy_bench.py --out $(GPU_OUT)/gpu_copy_bench.json
	PYTHONPATH=$(CURDIR) $(GPU_PY) benchmarks/region_bench.py --out $(GPU_OUT)/region_bench.json

clean:
	rm -rf $(VENV) build *.egg-info .pytest_cache .mypy_cache .ruff_cache

# P/D under load (benchmarks/pd_load.py): vLLM's own benchmark client through the proxy for
# colocated, OmniKV shared memory / Mooncake, ExampleConnector and NixlConnector (nixl comes
# with `make env`; without it the JSON records why NIXL did not run).
bench-load: env
	$(PY) benchmarks/pd_load.py
