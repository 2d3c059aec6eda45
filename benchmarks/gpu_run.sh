#!/usr/bin/env bash
# gpu_run.sh - the GPU run of docs/benchmarks/gpu.md, in its two halves.
#
# Here (the project root, no GPU needed), once:
#     bash benchmarks/gpu_run.sh prepare
#   stages vLLM 0.33.0 in .gpu/c01 .. .gpu/c03 (../shared/gpu/stage.sh), writes the dummy-model folders
#   (.gpu/models: config.json + tokenizer, no weights) and the pytest wheels the GPU machine lacks
#   (.gpu/extra), and prints the three device commands.
#
# On the GPU machine, calls in a row (the machine must stay warm between them):
#   1  carry .gpu/c01:                          mkdir -p /tmp/gpu_parts && cp .gpu/c01/* /tmp/gpu_parts/
#   2  carry .gpu/c02:                          cp .gpu/c02/* /tmp/gpu_parts/
#   3  carry .gpu/c03 .gpu/models .gpu/extra:   cp .gpu/c03/* /tmp/gpu_parts/ && bash benchmarks/gpu_run.sh device quick
#   4  carry .gpu/models .gpu/extra:            bash benchmarks/gpu_run.sh device
#   `device` assembles and installs vLLM into /tmp/site (once per machine: a later call on the same warm
#   machine reuses it), installs this project next to it (the plugin's entry point), then runs
#   `python3 benchmarks/gpu.py run` with what is left of 540 s, every figure into $OUT as it is measured
#   (<phase>.jsonl, <phase>.log, results.json, results.md, JUnit XML of the test phases).
#   `device quick`: the cheap first call, the import and the engine checks (phases env,engine);
#   `device` alone: every phase, in order of value (engine checks, then the 8k comparison, ...); a phase
#   that passed in an earlier call on the same machine is not run again (gpu.py run --done);
#   `device PHASES`: the phases or groups named (e.g. bench-v1,contract; `gpu.py run --dry-run` lists them).
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
    HYPOTHESIS_VERSION=$(.venv/bin/python -c 'import hypothesis; print(hypothesis.__version__)')
    # pytest for the test phases; hypothesis (with sortedcontainers, attrs) for tests/policies' property tests
    .venv/bin/python -m pip download -q --no-deps -d .gpu/extra "pytest==$PYTEST_VERSION" pluggy iniconfig \
      "hypothesis==$HYPOTHESIS_VERSION" sortedcontainers attrs
    du -sh .gpu/c0* .gpu/models .gpu/extra
    sed -n '/^# On the GPU machine/,/^#   4 /p' "$0"
    ;;
  device)
    PARTS=/tmp/gpu_parts SITE=/tmp/site
    case "${2:-}" in
      quick) PHASES=env,engine ;;
      "") PHASES=env,engine,bench-v2-8k,bench-v2-spare,kernels,bench-v1-8k,bench-v1-spare,contract ;;
      *) PHASES=$2 ;;
    esac
    export PYTHONPATH=$SITE VLLM_USE_FLASHINFER_SAMPLER=0 TVM_FFI_DISABLE_TORCH_C_DLPACK=1 HF_HUB_OFFLINE=1 \
           VLLM_NO_USAGE_STATS=1 PATH=$SITE/bin:$PATH   # the `vllm` command (tests/test_cli_flags.py)
    if [ ! -f "$SITE/.assembled" ]; then  # once per machine
      bash "$PARTS/assemble.sh" "$PARTS" "$SITE"
      touch "$SITE/.assembled"
    fi
    pip install -q --no-deps --no-build-isolation --target "$SITE" --upgrade .
    python3 -c "import vllm._C_stable_libtorch, vllm.vllm_flash_attn._vllm_fa3_C; from vllm import LLM"
    python3 -c "import pytest, hypothesis" 2>/dev/null \
      || pip install -q --no-index --no-deps --target "$SITE" .gpu/extra/*.whl
    OUT=${OUT:-/tmp/gpu-results}
    LEFT=$((${GPU_RUN_BUDGET_S:-540} - $(date +%s) + START))  # a shorter call: GPU_RUN_BUDGET_S
    echo "gpu_run: vLLM ready after $(( $(date +%s) - START )) s; ${LEFT} s left for phases ${PHASES}" >&2
    read -r -a EXTRA <<< "${GPU_RUN_ARGS:-}"  # e.g. GPU_RUN_ARGS="--full --kv-gib 30"
    python3 benchmarks/gpu.py run --models .gpu/models --out "$OUT" --deadline-s "$LEFT" --phases "$PHASES" \
      "${EXTRA[@]}"
    ;;
  *)
    echo "usage: bash benchmarks/gpu_run.sh prepare|device" >&2
    exit 2
    ;;
esac
