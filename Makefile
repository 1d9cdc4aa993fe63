# vidq — two set-up commands: `make demo` and `make test`. Everything else is `vidq …` inside .venv.
PYTHON ?= python3
VENV   := .venv
BIN    := $(VENV)/bin
# The CPU build of torch; GPU hosts install their CUDA build into the venv first (any torch in the range works).
TORCH  ?= torch==2.13.0

.PHONY: venv demo test lint gpu-bench clean

$(VENV)/.installed: pyproject.toml
	$(PYTHON) -m venv $(VENV)
	$(BIN)/python -m pip install -q --upgrade pip
	$(BIN)/python -c "import torch" 2>/dev/null || $(BIN)/python -m pip install -q "$(TORCH)"
	$(BIN)/python -m pip install -q -e '.[worker,embedded,dev]'
	touch $@

venv: $(VENV)/.installed

demo: venv
	HF_HUB_OFFLINE=1 $(BIN)/vidq demo

test: venv
	HF_HUB_OFFLINE=1 $(BIN)/python -m pytest -q -p no:cacheprovider --durations=15

lint: venv
	$(BIN)/ruff check shared services tools tests benchmarks migrations
	$(BIN)/ruff format --check shared services tools tests benchmarks migrations
	$(BIN)/mypy shared services tools

clean:
	rm -rf $(VENV) .vidq out
