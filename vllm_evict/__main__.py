"""``python -m vllm_evict COMMAND [ARGS...]``.

Each command is a ``"module:function"`` imported only when it runs, so that a light command never pulls
in vLLM. The function receives the remaining arguments (a list of str) and returns the exit status.
Add a command by adding an entry to ``COMMANDS`` (and a line to ``HELP``).
"""

from __future__ import annotations

import argparse
import importlib
import sys
from typing import Callable, Sequence

COMMANDS: dict[str, str] = {
    "policies": "vllm_evict.listing:main",
    "prepare-models": "vllm_evict.models:main",
    "serve": "vllm_evict.serve:main",
}
HELP: dict[str, str] = {
    "policies": "list the eviction methods and the valid META+BASE combinations",
    "prepare-models": "convert the GGUF models shipped by PyPI packages into cached HF folders",
    "serve": "start the OpenAI-compatible vLLM server with the --kv-eviction flags",
}


def resolve(command: str) -> Callable[[list[str]], int]:
    module, func = COMMANDS[command].split(":")
    return getattr(importlib.import_module(module), func)


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(
        prog="python -m vllm_evict", description="vllm-evict: per-head KV-cache token eviction for vLLM",
        epilog="The server's eviction flags: `python -m vllm_evict serve --help=all` (group \"KV eviction\"); "
               "every option with its default and range: docs/configuration.md in the vllm-evict repository.")
    sub = parser.add_subparsers(dest="command", metavar="COMMAND", required=True)
    for name in COMMANDS:
        # The command parses its own arguments (including --help), so its subparser takes none.
        sub.add_parser(name, help=HELP.get(name, ""), add_help=False)
    return parser


def main(argv: Sequence[str] | None = None) -> int:
    argv = list(sys.argv[1:] if argv is None else argv)
    parser = build_parser()
    # Only the command name is ours; everything after it belongs to the command.
    head = argv[:1] if argv and not argv[0].startswith("-") else argv
    args = parser.parse_args(head)
    rest = argv[1:]
    result = resolve(args.command)(rest)
    return int(result or 0)


if __name__ == "__main__":
    raise SystemExit(main())
