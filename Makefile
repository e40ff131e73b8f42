# Two commands matter: `make demo` (the library's main job) and `make test` (the whole suite).
# Each builds .venv on first use, with the versions CI tests (.ci/constraints.txt). Where no torch is
# installed, torch==2.13.0 is installed first, on its own, so that the `torch` dependency never pulls the
# multi-GB CUDA build on a CPU machine.
PYTHON ?= python3
VENV ?= .venv
PY := $(VENV)/bin/python
# CI machines have 2 cores; the suite is CPU-bound (Triton's interpreter), one worker per core.
JOBS ?= auto

.PHONY: demo test lint bench gpu-test clean

CONSTRAINTS := .ci/constraints.txt

$(VENV)/.installed: pyproject.toml $(CONSTRAINTS)
	$(PYTHON) -m venv $(VENV)
	$(PY) -m pip install -q --upgrade pip
	$(PY) -c "import torch" 2>/dev/null || $(PY) -m pip install -q -c $(CONSTRAINTS) torch
	$(PY) -m pip install -q -c $(CONSTRAINTS) -e ".[test]"
	touch $@

demo: $(VENV)/.installed
	$(PY) -m varlen.examples.train $(ARGS)

lint: $(VENV)/.installed
	$(PY) -m ruff check src tests bench tools

test: $(VENV)/.installed lint
	$(PY) -m pytest -q -n $(JOBS) tests

clean:
	rm -rf $(VENV) .pytest_cache .ruff_cache
