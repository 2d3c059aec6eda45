"""``python -m vllm_evict policies``: one line per eviction method, bases first, then meta scores."""

from __future__ import annotations

import argparse
import sys
from typing import Sequence

from vllm_evict.policies import BASE_POLICIES, META_POLICIES, load_class


def _load(name: str):
    """The policy class, or the reason it cannot be imported (a listing must never crash)."""
    try:
        return load_class(name), None
    except (ImportError, AttributeError) as err:
        return None, f"{type(err).__name__}: {err}"


def format_policies() -> str:
    """Every registered method on one line each: ``name  summary``, metas as ``META+BASE  summary
    (bases: ...)``."""
    bases = {name: _load(name) for name in BASE_POLICIES}
    rows: list[tuple[str, str]] = []
    for name, (cls, err) in bases.items():
        if cls is None:
            rows.append((name, f"(not available: {err})"))
            continue
        tags = [t for t, on in (("one-shot", cls.one_shot), ("attention mass", cls.is_attention_mass)) if on]
        suffix = f" [{', '.join(tags)}]" if tags else ""
        rows.append((name, f"{cls.summary}{suffix}"))
    for name in META_POLICIES:
        cls, err = _load(name)
        if cls is None:
            rows.append((f"{name}+BASE", f"(not available: {err})"))
            continue
        valid = [b for b, (bcls, _) in bases.items() if bcls is not None and cls.accepts(bcls)]
        rows.append((f"{name}+BASE", f"{cls.summary} (bases: {', '.join(valid) or 'none'})"))
    width = max(len(label) for label, _ in rows)
    lines = ["Spec: [META+]BASE, e.g. snapkv, caote+h2o, criticalkv+snapkv", ""]
    lines += [f"{label:<{width}}  {text}" for label, text in rows]
    return "\n".join(lines)


def main(argv: Sequence[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m vllm_evict policies",
                                     description="List the eviction methods and their spec names.")
    parser.parse_args(list(argv) if argv is not None else sys.argv[1:])
    print(format_policies())
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
