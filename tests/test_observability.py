"""docs/observability.md lists exactly the metrics of vllm_evict.metrics, and benchmarks/plots.py draws its
pictures from measured data (here a small hand-made data set: the drawing only, no engine). About 3 s."""

from __future__ import annotations

import re
from pathlib import Path

import pytest

from tests.scripts import loaded_script
REPO = Path(__file__).resolve().parents[1]


def test_the_docs_table_lists_every_metric_and_no_other() -> None:
    pytest.importorskip("vllm")
    from vllm_evict.metrics import Kind, Metric

    text = (REPO / "docs" / "observability.md").read_text()
    table = text.split("## 1. Metrics", 1)[1].split("\n\n")[2]
    documented = set(re.findall(r"^\| `(vllm:[a-z_]+)` \|", table, flags=re.M))
    exposed = {m.value.name + ("_total" if m.value.kind is Kind.COUNTER else "") for m in Metric}
    assert documented == exposed


def test_plots_are_drawn_from_the_data(tmp_path: Path) -> None:
    pytest.importorskip("matplotlib")
    with loaded_script("benchmarks/plots.py", "bench_plots") as module:
        run = {"steps": 3, "seconds": 1.0, "pages": {"prompt 300": [10, 10, 2], "prompt 700": [0, 22, 4]}}
        point = {"concurrency": 1, "seconds": 1.0, "generated": 10, "tokens_per_s": 10.0, "most_running": 1,
                 "preemptions": 0}
        data = {"setup": {"model": "m", "policy": "keydiff", "budget": 128, "pool_pages": 64, "gen_len": 8,
                          "prompt_len": 16},
                "pages_over_time": {"plain": run, "evict": run},
                "throughput": {"plain": [point], "evict": [{**point, "tokens_per_s": 12.0}]}}
        paths = module.draw(data, tmp_path)
    assert [p.name for p in paths] == [module.PAGES_PNG, module.THROUGHPUT_PNG]
    for path in paths:
        assert path.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n" and path.stat().st_size > 10_000
