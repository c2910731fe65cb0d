# The two commands: `make run` (install, then serve on http://127.0.0.1:7860) and `make test`.
# Both create .venv on first use. The install steps live in INSTALL below and nowhere else:
# the Dockerfile runs the same lines (tests/test_packaging.py checks that they match).

PYTHON ?= python3
VENV ?= .venv
BIN := $(VENV)/bin

.PHONY: run test test-fast lint install install-dev clean-data

$(VENV)/.installed: pre-requirements.txt requirements.txt
	test -x $(BIN)/python || $(PYTHON) -m venv $(VENV)
	# INSTALL (begin)
	$(BIN)/pip install -r pre-requirements.txt
	$(BIN)/pip install -r requirements.txt
	# INSTALL (end)
	touch $@

$(VENV)/.installed-dev: $(VENV)/.installed requirements-dev.txt
	$(BIN)/pip install --no-cache-dir -r requirements-dev.txt
	touch $@

install: $(VENV)/.installed

install-dev: $(VENV)/.installed-dev

run: install
	$(BIN)/python app.py

test: install-dev
	$(BIN)/python -m pytest -q $(PYTEST_ARGS)

# the quick loop while you work: everything but the real-model (`slow`) and browser tests
test-fast: install-dev
	$(BIN)/python -m pytest -q -m "not slow and not browser" $(PYTEST_ARGS)

# style and type checks (configured in pyproject.toml); CI runs them before the tests
lint: install-dev
	$(BIN)/ruff check llmweb tests
	$(BIN)/ruff format --check llmweb tests
	$(BIN)/mypy llmweb

clean-data:
	rm -rf data/models data/index data/*.sqlite3* data/reports
