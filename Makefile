# accelab: `make demo` installs everything, fetches the offline models and prints the main table;
# `make test` runs the test suite. Both work on a fresh machine.
PYTHON ?= python3
VENV ?= .venv
BIN := $(VENV)/bin
# torch is installed first and pinned: a plain `torch` would pull a multi-GB CUDA build here.
TORCH_SPEC ?= torch==2.13.0
PYTEST_ARGS ?=
LLAMA_CMAKE_ARGS ?= -DGGML_NATIVE=ON -DCMAKE_C_FLAGS=-mno-amx-int8 -DCMAKE_CXX_FLAGS=-mno-amx-int8

.PHONY: install models browser demo test clean

$(BIN)/python:
	$(PYTHON) -m venv $(VENV)
	$(BIN)/pip install --quiet --upgrade pip

$(VENV)/.installed: pyproject.toml | $(BIN)/python
	$(BIN)/pip install --quiet "$(TORCH_SPEC)"
	# llama-cpp-python compiles llama.cpp for this CPU (~7 min on 2 cores), never from pip's wheel
	# cache: a cached wheel may have been built for another CPU. No AMX: on the VMs seen here
	# ggml's AMX kernels die with SIGILL (tilezero) in its worker threads.
	CMAKE_ARGS="$(LLAMA_CMAKE_ARGS)" $(BIN)/pip install --quiet --no-cache-dir "llama-cpp-python>=0.3.36,<0.4"
	$(BIN)/pip install --quiet -e ".[test,llamacpp,ray]"
	touch $@

install: $(VENV)/.installed

models: install
	$(BIN)/accelab models fetch --all

demo: models
	$(BIN)/accelab env
	PATH=$(abspath $(BIN)):$$PATH bash examples/demo.sh

# the report's screenshot test renders pages in headless Chromium: Debian's package, when missing
browser:
	@command -v chromium >/dev/null 2>&1 || command -v chromium-browser >/dev/null 2>&1 || \
	  (apt-get install -y -qq chromium >/dev/null 2>&1 || (apt-get update -qq && apt-get install -y -qq chromium)) || \
	  echo "note: could not install chromium (apt-get install -y chromium, as root): the screenshot test will fail"

test: models browser
	$(BIN)/python -m pytest $(PYTEST_ARGS)

clean:
	rm -rf $(VENV) build dist src/*.egg-info
