# make demo | make test | make bench | make lint — each sets up .venv on first use.
PYTHON ?= python3
VENV   ?= .venv
BIN    := $(VENV)/bin
STAMP  := $(VENV)/.installed
CLI    := $(BIN)/inf2-pipeline
DEMO_CONFIG := configs/tiny-llama.yaml

.PHONY: demo test bench lint clean venv

venv: $(STAMP)

# torch is pinned first so that pip takes the local CPU build instead of a multi-GB CUDA one.
$(STAMP): pyproject.toml
	$(PYTHON) -m venv $(VENV)
	$(BIN)/python -m pip install -q --upgrade pip
	$(BIN)/python -m pip install -q torch==2.13.0
	$(BIN)/python -m pip install -q -e '.[torch,plot,dev]'
	touch $@

demo: $(STAMP)
	$(CLI) tiny-model models/tiny-llama --overwrite
	$(CLI) validate $(DEMO_CONFIG)
	$(CLI) plan $(DEMO_CONFIG)
	$(CLI) release $(DEMO_CONFIG) --jobs 2

test: $(STAMP)
	$(BIN)/python -m pytest -q

bench: $(STAMP)
	@for b in bench/bench_*.py; do echo "== $$b"; $(BIN)/python $$b || exit 1; done

lint: $(STAMP)
	$(BIN)/ruff check pipeline tests bench

clean:
	rm -rf $(VENV) models/tiny-llama .pytest_cache
