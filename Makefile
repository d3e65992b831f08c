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

.PHONY: env test lint typecheck pytest demo demo-ar bench clean doctor

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
	$(VENV)/bin/python -m pytest $(PYTEST_ARGS)

test: lint typecheck pytest

doctor: env
	$(VENV)/bin/vllm-omni-kv doctor --selftest

demo: env
	$(PY) examples/disaggregated_prefill/run_demo.py

demo-ar: env
	$(PY) examples/ar_to_diffusion/run_demo.py

bench: env
	$(PY) benchmarks/transfer_bench.py

clean:
	rm -rf $(VENV) build *.egg-info .pytest_cache .mypy_cache .ruff_cache
