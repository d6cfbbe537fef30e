# accelab: `make demo` installs everything, fetches the offline models and prints the main table;
# `make test` runs the test suite. Both work on a fresh machine.
PYTHON ?= python3
VENV ?= .venv
BIN := $(VENV)/bin
# torch is installed first and pinned: a plain `torch` would pull a multi-GB CUDA build here.
TORCH_SPEC ?= torch==2.13.0
PYTEST_ARGS ?=

.PHONY: install models browser demo test clean

$(BIN)/python:
	$(PYTHON) -m venv $(VENV)
	$(BIN)/pip install --quiet --upgrade pip

$(VENV)/.installed: pyproject.toml | $(BIN)/python
	$(BIN)/pip install --quiet "$(TORCH_SPEC)"
	# llama-cpp-python builds from source once (~7 min on 2 cores); pip's wheel cache reuses it
	CMAKE_ARGS="-DGGML_NATIVE=ON" $(BIN)/pip install --quiet -e ".[test,llamacpp,ray]"
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
