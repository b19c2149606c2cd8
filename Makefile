# Two jobs for a newcomer: `make demo` and `make test`. Each sets up .venv first: kvshare with every extra the tests
# use (engine: torch, pinned to the 2.13.0 CPU build installed just before; l2: redis; dev), editable.
PY ?= python3
VENV := .venv
STAMP := $(VENV)/.installed-$(shell cksum pyproject.toml | cut -d' ' -f1)
PYTEST_ARGS ?=
DEMO_ARGS ?=  # e.g. DEMO_ARGS="--preset small-hybrid": the same comparison on a hybrid (Qwen3.5-style) model

.PHONY: setup demo test quick lint bench clean

$(STAMP): pyproject.toml
	$(PY) -m venv $(VENV)
	$(VENV)/bin/pip install -q --upgrade pip
	$(VENV)/bin/pip install -q torch==2.13.0
	$(VENV)/bin/pip install -q -e '.[engine,l2,dev]'
	rm -f $(VENV)/.installed-* && touch $(STAMP)

setup: $(STAMP)

demo: $(STAMP)
	$(VENV)/bin/kvshare demo $(DEMO_ARGS)

# The whole suite, after the linters (what CI runs).
test: lint
	$(VENV)/bin/python -m pytest $(PYTEST_ARGS)

# The inner loop: every test not marked slow.
quick: $(STAMP)
	$(VENV)/bin/python -m pytest -m "not slow" $(PYTEST_ARGS)

# ruff (pyproject.toml [tool.ruff]) and the layering contracts (pyproject.toml [tool.importlinter]).
lint: $(STAMP)
	$(VENV)/bin/ruff check kvshare tests experiments
	$(VENV)/bin/lint-imports

bench: $(STAMP)
	$(VENV)/bin/kvshare bench pool

clean:
	rm -rf $(VENV) .pytest_cache .hypothesis
