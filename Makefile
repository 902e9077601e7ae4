# The one way to set up and check Tessera. `make install` is idempotent.
PY ?= python3
VENV := .venv
BIN := $(VENV)/bin
STAMP := $(VENV)/.installed

.PHONY: install test test-quick lint demo clean

install: $(STAMP)

$(STAMP): pyproject.toml constraints.txt
	test -d $(VENV) || $(PY) -m venv $(VENV)
	$(BIN)/pip install -q --upgrade pip
	$(BIN)/pip install -q -c constraints.txt torch==2.13.0
	$(BIN)/pip install -q -c constraints.txt -e '.[dev]'
	touch $(STAMP)

test: install
	OMP_NUM_THREADS=1 $(BIN)/python -m pytest -q tests

test-quick: install
	OMP_NUM_THREADS=1 $(BIN)/python -m pytest -q -m "not slow" tests

lint: install
	$(BIN)/ruff check tessera tests bench

clean:
	rm -rf $(VENV) build *.egg-info
