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

.PHONY: venv install build system-deps run test test-fast slow-tests lint clean distclean

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

# Debian tools the tests use: graphviz draws `mlafx inspect --html` graphs, headless
# chromium renders that report, redis-server backs the redis:// KV-store tests (each test
# session starts its own on a free loopback port). Installed once (as root, like CI);
# skipped when present; redone when this Makefile changes the list.
system-deps: $(STAMPS)/system-deps
$(STAMPS)/system-deps: Makefile
	if ! command -v dot >/dev/null || ! command -v chromium >/dev/null \
		|| ! command -v redis-server >/dev/null; then \
		apt-get update -qq && DEBIAN_FRONTEND=noninteractive apt-get install -y -qq \
			graphviz chromium redis-server; \
	fi
	mkdir -p $(STAMPS) && touch $@

# Two pytest workers (pytest-xdist): a cold compile is mostly one process (inductor's Python,
# one g++), so two of them keep both cores busy; `worksteal` hands an idle worker the other's
# queued tests, so a long test near the end of one share does not leave a core idle.
TEST_WORKERS ?= 2
XDIST = -n $(TEST_WORKERS) --dist worksteal
test: install system-deps
	$(PY) -m pytest -q $(XDIST) tests

# The suite minus the tests tests/slow_tests.txt lists (cold compiles, long sweeps).
test-fast: install system-deps
	$(PY) -m pytest -q $(XDIST) -m "not slow" tests

# Re-measure which tests are slow (~1 h here): a cold serial run of the suite, then of its fast
# tier, and rewrite tests/slow_tests.txt from both (tests/record_slow_tests.py says why both).
SLOW_RUN = rm -rf .cache/slow-tests/compiled .cache/slow-tests/inductor && \
	MLAFX_CACHE_DIR=.cache/slow-tests/compiled TORCHINDUCTOR_CACHE_DIR=.cache/slow-tests/inductor \
	$(PY) -m pytest -q -p no:cacheprovider
slow-tests: install system-deps
	mkdir -p .cache/slow-tests
	$(SLOW_RUN) --junitxml=.cache/slow-tests/all.xml tests || true
	$(SLOW_RUN) --junitxml=.cache/slow-tests/fast.xml -m "not slow" tests || true
	$(PY) tests/record_slow_tests.py .cache/slow-tests/all.xml .cache/slow-tests/fast.xml

# ruff, then mypy on the package (its settings: pyproject.toml [tool.mypy])
lint: install
	$(VENV)/bin/ruff check $(LINT_PATHS)
	$(VENV)/bin/ruff format --check $(LINT_PATHS)
	$(VENV)/bin/mypy

# Build outputs and the install stamp; keeps .venv (see distclean).
clean:
	rm -rf build build-sanitize *.egg-info mlafx/*.so mlafx/kernels/_build_info.py \
		$(STAMPS)/install .pytest_cache .hypothesis .ruff_cache
	find . -path ./$(VENV) -prune -o -name __pycache__ -type d -exec rm -rf {} +

distclean: clean
	rm -rf $(VENV) $(STAMPS)

# Opt-in (not part of `make test`): the extension rebuilt with AddressSanitizer +
# UndefinedBehaviorSanitizer in a copy of the tree under build-sanitize/, then the kernel tests
# run against it. Python itself is not instrumented, so the ASan runtime is preloaded.
SANITIZE_DIR := build-sanitize
SANITIZE_FLAGS := -fsanitize=address,undefined -fno-sanitize-recover=undefined -fno-omit-frame-pointer
.PHONY: sanitize
sanitize: install
	rm -rf $(SANITIZE_DIR) && mkdir -p $(SANITIZE_DIR)
	cp -r setup.py pyproject.toml mlafx tests $(SANITIZE_DIR)/
	rm -f $(SANITIZE_DIR)/mlafx/*.so
	# CXXFLAGS: setuptools compiles .cpp with compiler_so_cxx, which reads CXXFLAGS, not CFLAGS.
	cd $(SANITIZE_DIR) && CFLAGS="$(SANITIZE_FLAGS)" CXXFLAGS="$(SANITIZE_FLAGS)" \
		LDFLAGS="-fsanitize=address,undefined" \
		../$(PY) setup.py -q build_ext --inplace
	cd $(SANITIZE_DIR) && PYTHONPATH=. ASAN_OPTIONS=detect_leaks=0:detect_odr_violation=0 \
		UBSAN_OPTIONS=print_stacktrace=1 \
		LD_PRELOAD="$$(gcc -print-file-name=libasan.so) $$(gcc -print-file-name=libubsan.so)" \
		../$(PY) -m pytest -q -p no:cacheprovider tests/test_kernel_*.py
