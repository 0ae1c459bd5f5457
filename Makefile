# Developer and CI entry points. Stamp files under .make/ make re-runs instant; a stamp is
# redone when the files it depends on change. CI runs `bash .ci/run` (= make test) in a
# fresh clone.
SHELL := bash
.SHELLFLAGS := -euo pipefail -c
.DEFAULT_GOAL := install

PYTHON ?= python3
VENV := .venv
PY := $(VENV)/bin/python
PIP := $(VENV)/bin/pip
STAMPS := .make
# Pinned: an unpinned `torch` resolves to a multi-GB CUDA build.
TORCH := torch==2.13.0
# Everything the C++ build reads; a change re-runs the (editable) install.
BUILD_INPUTS := pyproject.toml setup.py mlafx/kernels/source_hash.py \
	mlafx/kernels/csrc $(wildcard mlafx/kernels/csrc/*)
LINT_PATHS := mlafx tests bench

.PHONY: venv install build run test lint clean distclean

venv: $(STAMPS)/venv
$(STAMPS)/venv:
	test -x $(PY) || $(PYTHON) -m venv $(VENV)
	$(PIP) install '$(TORCH)' setuptools wheel ninja
	mkdir -p $(STAMPS) && touch $@

# --no-build-isolation: the extension must be compiled against the torch in .venv.
install: $(STAMPS)/install
build: install
$(STAMPS)/install: $(STAMPS)/venv $(BUILD_INPUTS)
	$(PIP) install --no-build-isolation -e '.[dev]'
	$(PY) -c 'import mlafx.kernels'
	touch $@

run: install
	$(VENV)/bin/mlafx run

test: install
	$(PY) -m pytest -q tests

lint: install
	$(VENV)/bin/ruff check $(LINT_PATHS)
	$(VENV)/bin/ruff format --check $(LINT_PATHS)

# Build outputs and the install stamp; keeps .venv (see distclean).
clean:
	rm -rf build *.egg-info mlafx/*.so mlafx/kernels/_build_info.py \
		$(STAMPS)/install .pytest_cache .hypothesis .ruff_cache
	find . -path ./$(VENV) -prune -o -name __pycache__ -type d -exec rm -rf {} +

distclean: clean
	rm -rf $(VENV) $(STAMPS)
