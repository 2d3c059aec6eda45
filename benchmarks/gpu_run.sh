#!/usr/bin/env bash
# gpu_run.sh - the GPU run of docs/benchmarks/gpu.md, in its two halves.
#
# Here (the project root, no GPU needed), once:
#     bash benchmarks/gpu_run.sh prepare
#   stages vLLM 0.33.0 in .gpu/c01 .. .gpu/c03 (../shared/gpu/stage.sh), writes the dummy-model folders
#   (.gpu/models: config.json + tokenizer, no weights) and the pytest wheels the GPU machine lacks
#   (.gpu/extra), and prints the three device commands.
#
# On the GPU machine, three calls in a row (the machine must stay warm between them):
#   1  carry .gpu/c01:                          mkdir -p /tmp/gpu_parts && cp .gpu/c01/* /tmp/gpu_parts/
#   2  carry .gpu/c02:                          cp .gpu/c02/* /tmp/gpu_parts/
#   3  carry .gpu/c03 .gpu/models .gpu/extra:   cp .gpu/c03/* /tmp/gpu_parts/ && bash benchmarks/gpu_run.sh device
#   `device` assembles and installs vLLM into /tmp/site, installs this project next to it (the plugin's
#   entry point), then runs `python3 benchmarks/gpu.py run` with what is left of 560 s, results into $OUT
#   (results.json, results.md, one JSON per phase, JUnit XML of the test phases).
set -euo pipefail
cd "$(dirname "${BASH_SOURCE[0]}")/.."
START=$(date +%s)
MODE=${1:-}

case "$MODE" in
  prepare)
    for p in /.gpu/ /.gpu-stage/; do
      grep -qxF "$p" "$(git rev-parse --git-path info/exclude)" || echo "$p" >> "$(git rev-parse --git-path info/exclude)"
    done
    KIT=${GPU_KIT:-$(for k in ../shared/gpu ../../shared/gpu; do [ -f "$k/stage.sh" ] && echo "$k" && break; done)}
    [ -n "$KIT" ] || { echo "gpu_run: the GPU kit (shared/gpu/stage.sh) is not found; set GPU_KIT" >&2; exit 2; }
    [ -d .gpu/c01 ] || bash "$KIT/stage.sh"
    .venv/bin/python benchmarks/gpu.py prepare --out .gpu/models
    PYTEST_VERSION=$(.venv/bin/python -c 'import pytest; print(pytest.__version__)')
    .venv/bin/python -m pip download -q --no-deps -d .gpu/extra "pytest==$PYTEST_VERSION" pluggy iniconfig
    du -sh .gpu/c0* .gpu/models .gpu/extra
    sed -n '/^# On the GPU machine/,/^#   .device. assembles/p' "$0"
    ;;
  device)
    PARTS=/tmp/gpu_parts SITE=/tmp/site
    bash "$PARTS/assemble.sh" "$PARTS" "$SITE"
    export PYTHONPATH=$SITE VLLM_USE_FLASHINFER_SAMPLER=0 TVM_FFI_DISABLE_TORCH_C_DLPACK=1 HF_HUB_OFFLINE=1 \
           VLLM_NO_USAGE_STATS=1 PATH=$SITE/bin:$PATH   # the `vllm` command (tests/test_cli_flags.py)
    pip install -q --no-deps --no-build-isolation --target "$SITE" .
    python3 -c "import vllm._C_stable_libtorch, vllm.vllm_flash_attn._vllm_fa3_C; from vllm import LLM"
    python3 -c "import pytest" 2>/dev/null || pip install -q --no-index --no-deps --target "$SITE" .gpu/extra/*.whl
    OUT=${OUT:-/tmp/gpu-results}
    LEFT=$((560 - $(date +%s) + START))
    echo "gpu_run: vLLM ready after $(( $(date +%s) - START )) s; ${LEFT} s left for the phases" >&2
    read -r -a EXTRA <<< "${GPU_RUN_ARGS:-}"  # e.g. GPU_RUN_ARGS="--phases engine,bench"
    python3 benchmarks/gpu.py run --models .gpu/models --out "$OUT" --deadline-s "$LEFT" "${EXTRA[@]}"
    ;;
  *)
    echo "usage: bash benchmarks/gpu_run.sh prepare|device" >&2
    exit 2
    ;;
esac
