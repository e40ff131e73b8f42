# Two commands matter: `make demo` (the library's main job) and `make test` (the whole suite).
# Each builds .venv on first use. Where no torch is installed, the CPU build torch==2.13.0 is
# installed first, so that the `torch` dependency never pulls the multi-GB CUDA build on a CPU machine.
PYTHON ?= python3
VENV ?= .venv
PY := $(VENV)/bin/python
# CI machines have 2 cores; the suite is CPU-bound (Triton's interpreter), one worker per core.
JOBS ?= auto

.PHONY: demo test lint bench gpu-test clean

$(VENV)/.installed: pyproject.toml
	$(PYTHON) -m venv $(VENV)
	$(PY) -m pip install -q --upgrade pip
	$(PY) -c "import torch" 2>/dev/null || $(PY) -m pip install -q torch==2.13.0
	$(PY) -m pip install -q -e ".[test]"
	touch $@

demo: $(VENV)/.installed
	$(PY) -m varlen.examples.train $(ARGS)

lint: $(VENV)/.installed
	$(PY) -m ruff check src tests bench

test: $(VENV)/.installed lint
	$(PY) -m pytest -q -n $(JOBS) tests

clean:
	rm -rf $(VENV) .pytest_cache .ruff_cache
