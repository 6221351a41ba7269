# `make demo` and `make test` do all set-up on a fresh machine (Python 3.11+, no GPU needed).
VENV ?= .venv
PY := $(VENV)/bin/python
TINY := out/tiny-llama

.PHONY: setup demo test lint

setup: $(VENV)/.installed

$(VENV)/.installed: pyproject.toml
	python3 -m venv $(VENV)
	$(PY) -m pip install -q --upgrade pip
	$(PY) -m pip install -q torch==2.13.0 "numpy<2.4"  # the CPU build this machine's index serves
	$(PY) -m pip install -q -e ".[test]" "numpy<2.4"
	touch $@

demo: setup
	$(VENV)/bin/tandem make-tiny-model $(TINY) --arch llama
	$(VENV)/bin/tandem generate $(TINY) "The engine" "Once upon a time" "café au lait" \
		--max-tokens 32 --num-blocks 256 --quiet --trace out/demo_trace.json
	$(VENV)/bin/tandem generate $(TINY) "The engine" "Once upon a time" "café au lait" \
		--max-tokens 32 --num-blocks 256 --quiet --no-async-batching
	$(VENV)/bin/tandem trace plot out/demo_trace.json -o out/demo_timeline.png

test: setup
	$(VENV)/bin/pytest -q -x -n 2 --dist loadfile  # a file a worker at a time: its fixtures start once

lint: setup
	$(VENV)/bin/ruff check src tests
