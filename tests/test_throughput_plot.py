"""benchmarks/throughput.py draws the fixed/elastic picture of docs/engine.md from its results."""

from __future__ import annotations

from pathlib import Path

import pytest

from tests.scripts import loaded_script


@pytest.fixture(scope="module")
def bench():
    with loaded_script("benchmarks/throughput.py", "bench_throughput") as module:
        yield module


def result(ratio: float, preemptions: int, compressions: int, hits: int = 0) -> dict:
    return dict(ratio=ratio, preemptions=preemptions, compressions=compressions, passkey_hits=hits)


def test_modes_picture_is_drawn_from_results(bench, tmp_path: Path) -> None:
    results = {
        "tight": {"scenario": {"requests": 8, "pool_tokens": 4096, "passkeys": 0},
                  "results": {"vanilla": result(1.0, 6, 0), "keydiff 448": result(2.2, 0, 0),
                              "elastic keydiff 448": result(2.3, 0, 12)},
                  "ceiling": {"ceiling": 2.6}},  # drawn as a dashed line
        "host": {"1": {}},  # not part of the picture
    }
    path = bench.draw_modes(results, tmp_path / "modes.png")
    assert path.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n" and path.stat().st_size > 10_000


def test_modes_picture_needs_a_scenario(bench, tmp_path: Path) -> None:
    with pytest.raises(ValueError, match=r"no scenario of \('spare', 'tight', 'mixed'\) in the results"):
        bench.draw_modes({"host": {}}, tmp_path / "modes.png")
