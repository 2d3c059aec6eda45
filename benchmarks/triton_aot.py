"""Compile every Triton kernel variant a GPU server launches, ahead of time and without a GPU, and report
each one's registers, stack and spills.

    python benchmarks/triton_aot.py [--arch 90] [--dtype bfloat16,float16,float32,float8_e4m3fn] [--head-size 128] [--json F] [--md F]

1. *Record* (a subprocess under the Triton interpreter, CPU tensors): the server's start-up warm-up
   (``vllm_evict/engine/warmup.py``) runs every method's eviction step on a Llama-3.1-8B-shaped layer
   (32 query heads, 8 KV heads, the given head size and dtype, vLLM's NHD page layout, 16-token pages)
   with every operation on Triton (what a server without the CUDA extension runs: a superset), its
   launchers picking the constexprs a CUDA device gets (``kernels._common.launch_as_on_cuda``). Each
   distinct variant (``kernels.variants.variant_key``) is kept.
2. *Compile* (this process, Triton's JIT with a stand-in driver for the target ``cuda:<arch>``): each
   variant goes through ``JITFunction.warmup``, i.e. the same specialisation and compile pipeline as a
   launch, down to the cubin (Triton's bundled ptxas). Resources: ``ptxas -v`` on the kernel's PTX with
   the flags Triton uses (registers, stack frame, spill stores/loads) and ``cuobjdump
   --dump-resource-usage`` on the cubin Triton produced.

Exit status 1 when a variant fails to compile. Needs a Triton with the NVIDIA backend (the GPU build's:
``.venv-gpu``); CI runs it through ``make gpu-triton``.
"""

from __future__ import annotations

import argparse
import importlib
import json
import os
import re
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parents[1]
HOT = ("_window_lse_kernel", "_window_colsum_kernel", "_keydiff_sum_kernel", "_keydiff_score_kernel",
       "_center_sum_kernel", "_output_error_kernel", "_compact_kernel")


# ---- 1. record (Triton interpreter) ----------------------------------------------------------------
def record(dtype_name: str, head_size: int) -> list[dict[str, Any]]:
    import torch

    from vllm_evict import ops
    from vllm_evict.engine.warmup import WarmupGeometry, warm_up
    from vllm_evict.kernels._common import launch_as_on_cuda
    from vllm_evict.kernels.variants import LaunchRecorder

    dtype = getattr(torch, dtype_name)
    # An fp8 name records a bfloat16 model over vLLM's fp8 cache (#29): bytes viewed as float8, one fp32
    # scale per layer for K and V, queries and o_proj in bfloat16.
    fp8 = dtype if dtype in (torch.float8_e4m3fn, torch.float8_e5m2) else None
    dtype = torch.bfloat16 if fp8 is not None else dtype
    # Llama-3.1-8B's GQA group (4 query heads per KV head) with fewer heads: a compiled variant depends on
    # the group size and on the value class of the strides (all divisible by 16 either way), not on the
    # head count, and the interpreter runs 4x faster.
    pages, page, h_kv, h_q = 4, 16, 2, 8
    raw = torch.zeros(pages, page, h_kv, 2 * head_size, dtype=dtype if fp8 is None else torch.uint8)  # vLLM's NHD
    k, v = raw.transpose(1, 2).split(head_size, dim=-1)  # pages, K and V halves
    scales: dict[str, Any] = {}
    if fp8 is not None:
        k, v = k.view(fp8), v.view(fp8)
        scales = dict(k_scale=torch.ones(1), v_scale=torch.ones(1), dtype=dtype)
    # Only the value class of o_proj's row count is specialised (4096 and 256 alike: divisible by 16).
    o_proj = torch.zeros(256, h_q * head_size, dtype=dtype)
    geometry = WarmupGeometry(k=k, v=v, query_heads=h_q, scale=head_size ** -0.5, **scales)
    with ops.use_backend("triton"), launch_as_on_cuda(), LaunchRecorder() as recorder:
        warm_up(geometry, o_proj=lambda: o_proj)
    return [launch.describe() for launch in recorder.variants().values()]


# ---- 2. compile (Triton JIT, no GPU) ---------------------------------------------------------------
class _TargetDriver:
    """Enough of Triton's driver for ``JITFunction.warmup`` to compile for ``target`` without a GPU."""

    def __init__(self, target: Any) -> None:
        self.target = target

    def get_current_device(self) -> int:
        return 0

    def get_current_stream(self, device: int | None = None) -> int:
        return 0

    def get_current_target(self) -> Any:
        return self.target

    def get_active_torch_device(self) -> Any:
        import torch

        return torch.device("cpu")


def _kernel(name: str) -> Any:
    module, _, attr = name.rpartition(".")
    return getattr(importlib.import_module(module), attr)


def compile_variant(variant: dict[str, Any]) -> Any:
    import torch

    args = [getattr(torch, a["dtype"]) if "dtype" in a else a["value"] for a in variant["args"]]
    return _kernel(variant["kernel"]).warmup(*args, grid=(1,), **variant["constexprs"], **variant["options"])


def _tool(name: str) -> str:
    import triton

    return str(Path(triton.__file__).parent / "backends" / "nvidia" / "bin" / name)


def resources(compiled: Any, arch: int) -> dict[str, Any]:
    """Registers, stack frame and spills of a compiled kernel: ptxas -v on its PTX (Triton's flags), and
    cuobjdump's view of the cubin Triton built."""
    out: dict[str, Any] = {"num_warps": compiled.metadata.num_warps, "num_stages": compiled.metadata.num_stages,
                           "shared_bytes": compiled.metadata.shared}
    gpu = f"sm_{arch}a" if arch >= 90 else f"sm_{arch}"
    with tempfile.TemporaryDirectory() as tmp:
        ptx, cubin = Path(tmp) / "k.ptx", Path(tmp) / "k.cubin"
        ptx.write_text(compiled.asm["ptx"])
        cubin.write_bytes(compiled.asm["cubin"])
        log = subprocess.run([_tool("ptxas"), "-lineinfo", "-v", "--regAllocOptLevel=2", f"--gpu-name={gpu}",
                              str(ptx), "-o", str(Path(tmp) / "again.cubin")], capture_output=True, text=True)
        text = log.stdout + log.stderr
        for field, pattern in (("registers", r"Used (\d+) registers"), ("stack_bytes", r"(\d+) bytes stack frame"),
                               ("spill_store_bytes", r"(\d+) bytes spill stores"),
                               ("spill_load_bytes", r"(\d+) bytes spill loads")):
            match = re.search(pattern, text)
            out[field] = int(match.group(1)) if match else None
        dump = subprocess.run([_tool("cuobjdump"), "--dump-resource-usage", str(cubin)], capture_output=True,
                              text=True)
        match = re.search(r"REG:(\d+) STACK:(\d+) SHARED:(\d+) LOCAL:(\d+)", dump.stdout)
        if match:
            out["cubin"] = dict(zip(("registers", "stack", "shared", "local"), map(int, match.groups())))
    return out


def _label(variant: dict[str, Any]) -> str:
    """Kernel, the dtype of its first tensor (which cache it reads or moves) and its non-tile constexprs."""
    name = variant["kernel"].rsplit(".", 1)[-1]
    first = next((a["dtype"] for a in variant["args"] if "dtype" in a), "")
    shown = {k: v for k, v in variant["constexprs"].items() if not k.startswith("BLOCK")}
    return f"{name} ({first})" + (" " + ", ".join(f"{k}={v}" for k, v in shown.items()) if shown else "")


def compile_all(variants: list[dict[str, Any]], arch: int) -> list[dict[str, Any]]:
    from triton.backends.compiler import GPUTarget
    from triton.runtime.driver import driver

    previous = driver._active  # reset_active() would build the default driver, which needs a GPU
    driver.set_active(_TargetDriver(GPUTarget("cuda", arch, 32)))
    results = []
    try:
        for variant in variants:
            start = time.perf_counter()
            row = {"kernel": variant["kernel"].rsplit(".", 1)[-1], "variant": _label(variant),
                   "constexprs": variant["constexprs"]}
            try:
                compiled = compile_variant(variant)
                row.update(resources(compiled, arch))
                row["ok"] = True
            except Exception as exc:  # reported, and the run fails
                row.update(ok=False, error=f"{type(exc).__name__}: {exc}"[:2000])
            row["compile_s"] = round(time.perf_counter() - start, 2)
            results.append(row)
    finally:
        driver._active = previous
    return results


def markdown(results: list[dict[str, Any]], arch: int, dtype: str, head_size: int) -> str:
    lines = [f"### {dtype}, head size {head_size}", "",
             "| variant | warps | stages | registers | stack (B) | spill st/ld (B) | shared (B) |",
             "|---|---|---|---|---|---|---|"]
    for r in sorted(results, key=lambda r: r["variant"]):
        if not r.get("ok"):
            lines.append(f"| {r['variant']} | compile failed: {r.get('error', '')[:80]} | | | | | |")
            continue
        lines.append(f"| {r['variant']} | {r['num_warps']} | {r['num_stages']} | {r['registers']} | "
                     f"{r['stack_bytes']} | {r['spill_store_bytes']}/{r['spill_load_bytes']} | {r['shared_bytes']} |")
    return "\n".join(lines) + "\n"


def record_all(dtypes: list[str], head_size: int, keep: Path | None, reuse: bool) -> dict[str, list[dict[str, Any]]]:
    """Step 1 for each dtype, in subprocesses under the Triton interpreter running side by side
    (``keep``: the folder where the variants are kept; ``reuse``: read them from there instead)."""
    with tempfile.TemporaryDirectory() as tmp:
        folder = keep or Path(tmp)
        folder.mkdir(parents=True, exist_ok=True)
        paths = {dtype: folder / f"{dtype}.json" for dtype in dtypes}
        env = {**os.environ, "TRITON_INTERPRET": "1", "PYTHONPATH": os.pathsep.join(
            filter(None, [str(ROOT), os.environ.get("PYTHONPATH")]))}
        start = time.perf_counter()
        running = {dtype: subprocess.Popen([sys.executable, __file__, "--record", str(path), "--dtype", dtype,
                                            "--head-size", str(head_size)], env=env)
                   for dtype, path in paths.items() if not (reuse and path.exists())}
        for dtype, proc in running.items():
            if proc.wait() != 0:
                raise RuntimeError(f"recording the {dtype} variants failed (exit {proc.returncode})")
        if running:
            print(f"recorded {', '.join(running)} in {time.perf_counter() - start:.0f} s", flush=True)
        return {dtype: json.loads(path.read_text()) for dtype, path in paths.items()}


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--arch", type=int, default=90, help="compute capability as an int (90 = sm_90)")
    parser.add_argument("--dtype", default="bfloat16,float16,float32,float8_e4m3fn",
                        help="model dtypes, comma-separated (float8_e4m3fn / float8_e5m2: bfloat16 over an fp8 KV cache)")
    parser.add_argument("--head-size", type=int, default=128)
    parser.add_argument("--json", type=Path, help="write the results here")
    parser.add_argument("--md", type=Path, help="write the markdown tables here")
    parser.add_argument("--variants", type=Path, help="keep the recorded variants in this folder (DTYPE.json)")
    parser.add_argument("--reuse", action="store_true", help="compile the variants kept in --variants")
    parser.add_argument("--num-warps", type=int, help="compile every variant with this many warps instead "
                        "(to compare with the launchers' choice)")
    parser.add_argument("--record", type=Path, help=argparse.SUPPRESS)  # internal: step 1 into this file
    args = parser.parse_args(argv)
    if args.record:
        args.record.write_text(json.dumps(record(args.dtype, args.head_size)))
        return 0
    runs, tables = [], []
    recorded = record_all(args.dtype.split(","), args.head_size, args.variants, args.reuse)
    for dtype, variants in recorded.items():
        if args.num_warps:
            for variant in variants:
                variant["options"]["num_warps"] = args.num_warps
        start = time.perf_counter()
        results = compile_all(variants, args.arch)
        print(f"{dtype}: {len(variants)} variants compiled in {time.perf_counter() - start:.0f} s", flush=True)
        runs.append({"dtype": dtype, "variants": results})
        tables.append(markdown(results, args.arch, dtype, args.head_size))
    text = (f"Every Triton kernel variant a server launches (Llama-3.1-8B's GQA group, vLLM's NHD pages of 16), "
            f"compiled for sm_{args.arch} without a GPU: `python benchmarks/triton_aot.py --arch {args.arch} "
            f"--dtype {args.dtype} --head-size {args.head_size}`.\n\n" + "\n".join(tables))
    print(text)
    if args.json:
        args.json.write_text(json.dumps({"arch": args.arch, "head_size": args.head_size, "runs": runs}, indent=1))
    if args.md:
        args.md.write_text(text)
    failed = [r["variant"] for run in runs for r in run["variants"] if not r.get("ok")]
    spilled = [f"{run['dtype']} {r['variant']}" for run in runs for r in run["variants"]
               if r.get("ok") and (r.get("spill_store_bytes") or r.get("spill_load_bytes"))]
    if spilled:
        print(f"spills: {spilled}", file=sys.stderr)
    if failed:
        print(f"FAILED to compile: {failed}", file=sys.stderr)
        return 1
    return 0


if __name__ == "__main__":
    sys.exit(main())
