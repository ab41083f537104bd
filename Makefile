# waferline: `make demo` runs the demo (sol-mini streams text through a pipeline of stages, the planner sizes
# gpt-5.6-sol, an HTML report is written); `make test` runs the tests; `make lint` runs ruff. All set up .venv when missing.
PY ?= python3
VENV := .venv
BIN := $(VENV)/bin
STAMP := $(VENV)/.installed
TORCH_VERSION ?= 2.13.0

.PHONY: demo test lint venv clean

$(STAMP): pyproject.toml
	@test -x $(BIN)/python || $(PY) -m venv $(VENV)
	$(BIN)/python -m pip install -q --upgrade pip
	@# torch first: a local CPU build of torch is used where one exists, instead of a multi-GB CUDA download
	$(BIN)/python -c "import torch" 2>/dev/null || $(BIN)/python -m pip install -q "torch==$(TORCH_VERSION)" || $(BIN)/python -m pip install -q "torch>=2.5"
	$(BIN)/python -m pip install -q -e ".[test]"
	@touch $(STAMP)

venv: $(STAMP)

demo: $(STAMP)
	$(BIN)/waferline demo

test: $(STAMP)
	$(BIN)/python -m pytest tests

lint: $(STAMP)
	$(BIN)/ruff check src tests benchmarks train

clean:
	rm -rf $(VENV) build *.egg-info src/*.egg-info
