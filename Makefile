# Two commands on a fresh machine:
#
#   make demo    the main job: a small classifier on 2 CPU workers (or every GPU)
#   make test    the whole test suite, browser tests included
#
# Each creates what it needs on first use: .venv with the CPU build of torch
# first (a plain `torch` requirement would pull the CUDA wheels, several GB),
# then this package with its dev extras; for the tests also the experiment trackers
# in .venv-trackers, the multi-device test accelerator (a C++ extension, cached
# outside the checkout) and Debian's chromium,
# through apt when it is missing and this runs as root (or sudo needs no
# password). `.ci/run` calls `make test` too.
# `make docs` builds the documentation site (mkdocs.yml, docs/) into site/, offline.

PYTHON ?= python3
TORCH ?= torch==2.13.0
VENV := .venv
BIN := $(VENV)/bin
# 0 lets the browser tests skip where chromium cannot be installed.
REQUIRE_BROWSER_TESTS ?= 1
PYTEST_ARGS ?=
# Test processes side by side (pytest-xdist); 1 runs the suite in one process. Sized for
# 2 cores: the process that runs the Ray files waits on its clusters much of the time
# (its tests used under two thirds of a core, measured), so a third keeps both cores busy.
TEST_WORKERS ?= 3
XDIST = $(if $(filter-out 1,$(TEST_WORKERS)),-n $(TEST_WORKERS) --dist loadfile)
# Where `make docs` puts the site.
SITE ?= site

# What `make test-quick` leaves out: the slowest parts, each needing a service or a
# fresh environment (a browser, Ray clusters, Jupyter kernels, the docs site, the
# torch_xla environment, Accelerate's reference runs, a fresh Binder environment).
QUICK_LEAVES_OUT := tests/browser tests/launch/cluster tests/notebooks tests/docs tests/xla \
	tests/torch_range \
	tests/compat tests/test_binder.py

.PHONY: demo test test-quick env browser trackers testaccel docs

demo: $(VENV)/.installed
	$(BIN)/python -m notebook_accel.demo

# The suite runs in TEST_WORKERS processes (pytest-xdist), each test file whole in one
# of them (its module fixtures: a Ray cluster, a kernel, a site build are
# made once).
# Bytecode first: where PYTHONDONTWRITEBYTECODE is set (as on CI's machines) every fresh
# interpreter of the suite (spawned workers, kernels, Ray's workers) would compile this
# package from source again: 11% of the CPU of the spawn interrupt tests, measured.
test: $(VENV)/.installed browser trackers testaccel
	$(BIN)/python -m compileall -q notebook_accel tests >/dev/null
	REQUIRE_BROWSER_TESTS=$(REQUIRE_BROWSER_TESTS) REQUIRE_DEV_DEPENDENCIES=1 $(BIN)/python -m pytest $(XDIST) $(PYTEST_ARGS)

# For development only: CI runs `make test`, the whole proof.
test-quick: $(VENV)/.installed
	$(BIN)/python -m compileall -q notebook_accel tests >/dev/null
	$(BIN)/python -m pytest $(addprefix --ignore=,$(QUICK_LEAVES_OUT)) $(PYTEST_ARGS)

env: $(VENV)/.installed

# Strict: a broken link, a missing docstring or any other warning fails the build
# (NO_MKDOCS_2_WARNING quiets a banner Material prints on every build).
docs: $(VENV)/.installed
	NO_MKDOCS_2_WARNING=1 $(BIN)/python -m mkdocs build --strict --site-dir $(SITE)

# Redone when pyproject.toml changes (a new dependency).
$(VENV)/.installed: pyproject.toml
	test -x $(BIN)/python || $(PYTHON) -m venv $(VENV)
	$(BIN)/python -m pip install --quiet --upgrade pip
	$(BIN)/python -m pip install --quiet "$(TORCH)"
	$(BIN)/python -m pip install --quiet -e ".[dev]"
	touch $@

# The experiment trackers in an environment of their own beside .venv, for the
# real-tracker tests (see tests/accelerator/tracker_env.py); reused once built.
trackers: $(VENV)/.installed
	timeout 900 $(BIN)/python tests/accelerator/tracker_env.py

# The multi-device test accelerator (tests/testaccel): a C++ extension built with
# torch's cpp_extension into a cache outside the checkout (about 20 s on 2 cores the
# first time, reused after), before the test processes would race to build it.
testaccel: $(VENV)/.installed
	@command -v g++ >/dev/null || { echo "the test accelerator needs a C++ compiler:" \
	    "apt-get install g++" >&2; exit 1; }
	timeout 600 $(BIN)/python tests/testaccel/build.py

# Bounded, so that a stuck mirror fails the run instead of hanging it.
browser:
	@if [ "$(REQUIRE_BROWSER_TESTS)" = 1 ] && ! command -v chromium >/dev/null; then \
	    if [ "$$(id -u)" -eq 0 ]; then as_root=""; \
	    elif sudo -n true 2>/dev/null; then as_root="sudo -n"; \
	    else echo "chromium is missing and this is not root: install it (apt-get install" \
	        "chromium), or run 'make test REQUIRE_BROWSER_TESTS=0' to skip the browser tests" >&2; \
	        exit 1; fi; \
	    echo "installing chromium for the browser tests"; \
	    timeout 300 $$as_root apt-get update -qq >/dev/null && \
	    timeout 600 $$as_root env DEBIAN_FRONTEND=noninteractive \
	        apt-get install -y -qq --no-install-recommends chromium >/dev/null; \
	fi
