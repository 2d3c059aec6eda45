"""``python -m vllm_evict.csrc --arch 8.0 --arch 9.0 [--build-dir DIR]``: build the CUDA extension for
those architectures with the loader's flags (``vllm_evict.csrc.build_flags``) and import it. Needs nvcc
and a CUDA build of torch, not a GPU (CI's ``make gpu-build``)."""

from __future__ import annotations

import argparse
import sys
import time

from vllm_evict import csrc


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m vllm_evict.csrc", description=__doc__)
    parser.add_argument("--arch", action="append", required=True, help="compute capability, e.g. 9.0 (repeat)")
    parser.add_argument("--build-dir", default=None, help="build directory (default: torch's extension cache)")
    parser.add_argument("--verbose", action="store_true")
    args = parser.parse_args(argv)
    build, missing = csrc.supported_archs(args.arch, csrc.nvcc_archs())
    if missing:
        print(f"nvcc ({csrc.nvcc_path()}) cannot target {', '.join(missing)}; it supports "
              f"{', '.join(map(str, csrc.nvcc_archs())) or 'nothing (no nvcc?)'}", file=sys.stderr)
        return 2
    flags = csrc.build_flags(build)
    print(f"building {csrc.EXTENSION_NAME} for {', '.join(build)}: nvcc {' '.join(flags['extra_cuda_cflags'])}")
    start = time.perf_counter()
    module = csrc.compile_extension(build, build_directory=args.build_dir, verbose=args.verbose)
    missing_ops = [name for name in ("compact_", "window_mass") if not hasattr(module, name)]
    if missing_ops:
        print(f"the extension lacks {missing_ops}", file=sys.stderr)
        return 1
    print(f"ok: {module.__file__} ({time.perf_counter() - start:.0f} s)")
    return 0


if __name__ == "__main__":
    sys.exit(main())
