# make demo | make test | make bench | make lint — each sets up .venv on first use.
PYTHON ?= python3
VENV   ?= .venv
BIN    := $(VENV)/bin
STAMP  := $(VENV)/.installed
CLI    := $(BIN)/inf2-pipeline
DEMO_CONFIG := configs/tiny-llama.yaml

.PHONY: demo test bench lint clean venv neuron-venv

venv: $(STAMP)

# A side environment with optimum-neuron 0.4.5 (and its pins: transformers 4.57, optimum 2.0,
# CPU torch), apart from .venv whose transformers is 5.x. Tests run upstream's own parser,
# decoder registry and class signatures in it (tests/neuron_upstream.py); it never imports the
# pipeline. Built once, reused until this Makefile changes. No Neuron SDK: PyPI has only
# placeholders of it, and nothing here compiles or runs on a NeuronCore.
NEURON_VENV ?= .neuron-venv
NEURON_STAMP := $(NEURON_VENV)/.installed
OPTIMUM_NEURON := optimum-neuron==0.4.5

neuron-venv: $(NEURON_STAMP)

$(NEURON_STAMP): Makefile
	rm -rf $(NEURON_VENV)
	$(PYTHON) -m venv $(NEURON_VENV)
	$(NEURON_VENV)/bin/python -m pip install -q torch==2.13.0
	$(NEURON_VENV)/bin/python -m pip install -q '$(OPTIMUM_NEURON)'
	touch $@

# torch is pinned first so that pip takes the local CPU build instead of a multi-GB CUDA one.
$(STAMP): pyproject.toml
	$(PYTHON) -m venv $(VENV)
	$(BIN)/python -m pip install -q --upgrade pip
	$(BIN)/python -m pip install -q torch==2.13.0
	$(BIN)/python -m pip install -q -e '.[torch,serve,plot,dev]'
	touch $@

# tiny model → validate → plan → release (compile on cpu + publish to artifacts/) → promote
# → pull into pulled/ → load → generate beside Hugging Face's tokens → serve it and ask it with
# the OpenAI client. See scripts/demo.sh.
demo: $(STAMP)
	CLI=$(CLI) PY=$(BIN)/python scripts/demo.sh

# The two environments build side by side: pip compiles each package's bytecode on one core
# (43 of torch's 57 s of install on a 2-core machine), and the tests need that bytecode where
# PYTHONDONTWRITEBYTECODE is set. The tests run in two pytest-xdist workers, a test file to
# each at a time (a module's server starts once): one pytest used 1.2 of the 2 cores. The
# releases they compile are compiled once and shared (tests/shared_builds.py).
TEST_WORKERS ?= 2
test:
	$(MAKE) -j2 venv neuron-venv
	INF2_NEURON_VENV=$(abspath $(NEURON_VENV)) $(BIN)/python -m pytest -q \
		-n $(TEST_WORKERS) --dist loadfile

# CPU benchmarks; the GPU ones (bench_cuda_*.py) need an NVIDIA GPU: see bench/RESULTS.md.
bench: $(STAMP)
	$(BIN)/python bench/bench_fit.py
	$(BIN)/python bench/bench_compile_noop.py

lint: $(STAMP)
	$(BIN)/ruff check pipeline tests bench

clean:
	rm -rf $(VENV) $(NEURON_VENV) models/tiny-llama pulled work .pytest_cache
