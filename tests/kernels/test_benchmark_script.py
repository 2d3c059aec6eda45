"""benchmarks/kernels.py without a GPU: the report skeleton of ``--dry-run`` (tables, commands, computed
byte counts, no number invented), its CPU smoke run of the engine's eviction step on tiny shapes, and
that the step it times is the engine's (kept sets and recorded state against the dense reference).

About 15 s on a 2-core machine, most of it the smoke run (Triton kernels in the interpreter)."""

from __future__ import annotations

import re
from pathlib import Path

import pytest
import torch

from tests.scripts import loaded_script
from vllm_evict import dense, ops, paged
from vllm_evict.config import EvictionConfig

ROOT = Path(__file__).resolve().parents[2]
DOC = ROOT / "docs" / "benchmarks" / "kernels.md"
# Columns that hold measurements (times, rates, ratios, verdicts): never filled by a dry run.
MEASURED = re.compile(r"\(us\)|GB/s|of copy|TFLOP/s|/ attention|/ floor|>= 70%|target")
NUMBER = re.compile(r"^[0-9][0-9,]*(\.[0-9]+)?(e[-+][0-9]+)?%?$")


@pytest.fixture(scope="module")
def bench():
    with loaded_script("benchmarks/kernels.py", "bench_kernels") as module:
        yield module


def tables(text: str) -> list[tuple[list[str], list[list[str]]]]:
    """Every markdown table of a report: (header, rows of cells)."""
    split = lambda line: [c.strip() for c in line.strip().strip("|").split("|")]  # noqa: E731
    lines, out, i = text.splitlines(), [], 0
    while i < len(lines):
        if lines[i].startswith("| ") and i + 1 < len(lines) and lines[i + 1].startswith("|---"):
            header, rows, i = split(lines[i]), [], i + 2
            while i < len(lines) and lines[i].startswith("| "):
                rows.append(split(lines[i]))
                i += 1
            out.append((header, rows))
        else:
            i += 1
    return out


def measured_cells(table: tuple[list[str], list[list[str]]]) -> list[str]:
    header, rows = table
    columns = [j for j, name in enumerate(header) if MEASURED.search(name)]
    return [row[j] for row in rows for j in columns]


def row_of(table, *first: str) -> list[str]:
    matches = [row for row in table[1] if row[:len(first)] == list(first)]
    assert len(matches) == 1, f"{first}: {len(matches)} rows"
    return matches[0]


def cell(table, row: list[str], column: str) -> str:
    return row[table[0].index(column)]


def test_dry_run_writes_the_skeleton(bench, tmp_path):
    out = tmp_path / "kernels.md"
    assert bench.main(["--dry-run", "--out", str(out)]) == 0
    text = out.read_text()
    assert "**Unmeasured.**" in text and f"`{bench.GPU_COMMAND}`" in text and bench.SMOKE_COMMAND in text
    assert "{" not in text, "a placeholder was not formatted"
    kernel, norms, decode, chunk, decode_evict = tables(text)
    for table in (kernel, norms, decode, chunk, decode_evict):
        assert table[1], table[0]
        assert set(measured_cells(table)) <= {bench.UNMEASURED, "-"}, table[0]
    s = bench.LLAMA_8B
    cases = bench.kernel_cases(s)
    assert len(kernel[1]) == sum(len(c.backends()) for c in cases if c.op != "value_norms")
    assert len(norms[1]) == sum(len(c.backends()) for c in cases if c.op == "value_norms")
    for table in (decode, chunk, decode_evict):
        assert sorted((r[0], r[1]) for r in table[1]) == sorted((p, c) for p in bench.POLICIES for c in ("4k", "32k"))
    # Byte counts follow from the shapes, worked out by hand here: KeyDiff reads the keys of 64 rows x 4096
    # slots x 8 heads x 128 bf16 twice and writes an fp32 score per slot and head.
    keydiff = 2 * 64 * 4096 * 8 * 128 * 2 + 64 * 4096 * 8 * 4
    assert row_of(kernel, "keydiff_scores", "-", "4k", "64", "triton")[6] == f"{keydiff / 2**20:,.0f}"
    moved = 64 * 8 * 16384  # half of 32k kept: every kept slot of K, V (256 B each) and positions (4 B) moves
    assert row_of(kernel, "compact_tokens", "K, V, positions; half kept", "32k", "64", "cuda")[6] == \
        f"{(2 * moved * (2 * 256 + 4) + 8 * moved) / 2**20:,.0f}"
    assert row_of(kernel, "keydiff_scores", "-", "4k", "8", "torch")[4:6] == ["torch", bench.UNMEASURED]
    assert row_of(norms, "one prefill chunk", "2048", "triton")[4] == f"{2 * 2048 * 32 * 128 * 4096 / 1e9:.3g}"
    # h2o updates its state every step: its evict column is a measurement even when nothing evicts.
    evict = "evict, 1 layer (us)"
    assert cell(decode, row_of(decode, "h2o", "4k"), evict) == bench.UNMEASURED
    assert cell(decode, row_of(decode, "snapkv", "4k"), evict) == "-"
    # (b) keeps the context minus the 2k chunk, (c) evicts one page of 16 in 4 of the 64 rows.
    assert [cell(chunk, row_of(chunk, "keydiff", c), "kept") for c in ("4k", "32k")] == ["2,048", "30,720"]
    assert row_of(decode_evict, "keydiff", "32k")[2:4] == ["4 of 64", "32,752"]


def test_the_committed_report_is_the_dry_run(bench, tmp_path):
    text = DOC.read_text()
    if "**Unmeasured.**" not in text:
        pytest.skip("docs/benchmarks/kernels.md holds measured figures")
    out = tmp_path / "kernels.md"
    assert bench.main(["--dry-run", "--out", str(out)]) == 0
    assert text == out.read_text(), f"regenerate it: {bench.DRY_RUN_COMMAND}"


def test_bad_arguments_say_what_to_change(bench, capsys):
    with pytest.raises(SystemExit):
        bench.main(["--device", "cpu"])
    assert "--device cpu needs --small" in capsys.readouterr().err
    with pytest.raises(SystemExit):
        bench.main(["--dry-run", "--budget", "4000"])
    assert "--budget must be between 1 and 2048" in capsys.readouterr().err
    if not torch.cuda.is_available():
        assert bench.main(["--out", "unused.md"]) == 2
        assert "none is visible here" in capsys.readouterr().err


def test_cpu_smoke_run_measures_every_row(bench, tmp_path):
    out = tmp_path / "small.md"
    assert bench.main(["--device", "cpu", "--small", "--reps", "1", "--warmup", "0", "--out", str(out)]) == 0
    text = out.read_text()
    assert "CPU smoke run on tiny shapes" in text and "failed" not in text
    kernel, norms, decode, chunk, decode_evict = tables(text)
    for table in (kernel, norms, decode, chunk, decode_evict):
        cells = [c for c in measured_cells(table) if c != "-"]
        assert cells, table[0]
        bad = [c for c in cells if not (NUMBER.match(c) or c in ("met", "missed"))]
        assert not bad, f"{table[0]}: {bad}"
    backends = {row[4] for row in kernel[1]}
    assert backends == ({"torch", "triton"} if ops.interpreting() else {"torch"})
    s = bench.SMALL
    for table in (decode, chunk, decode_evict):
        assert len(table[1]) == len(bench.POLICIES) * len(s.contexts)
    # Every row evicts in (b), one in (c): the evict phase ran and was timed.
    assert all(NUMBER.match(cell(table, row, "evict, 1 layer (us)")) for table in (chunk, decode_evict)
               for row in table[1])
    assert {row[2] for row in decode_evict[1]} == {f"{s.evicting_rows} of {s.rows}"}


def test_the_timed_step_is_the_engine_step(bench):
    """On the benchmark's own batch: the record reaches every layer, each layer's computed state uses its
    own output projection, the rows short of their eviction add their query's attention (one softmax row
    per query head) to their window mass, and the evicting row keeps what the dense reference keeps while
    the others are untouched; the snapshot undoes the compaction."""
    s = bench.SMALL
    context = s.contexts[0]
    kv = bench.PagedKV(s, context, torch.device("cpu"))
    sc = next(x for x in bench.scenarios(s, context, None) if x.key == "decode_evict")
    inp = bench.StepInputs.build(kv, sc)
    pages, offsets = inp.slot_mapping // s.page_size, inp.slot_mapping % s.page_size
    budget = int(sc.keep[0])
    assert sc.keep.tolist() == [budget] + [-1] * (s.rows - 1)

    critical = bench.EvictionStep(kv, EvictionConfig.from_spec("criticalkv+snapkv", budget=budget).build_policy())
    critical.reset(sc)
    plan, initializers = critical.plan(sc, inp)
    critical.record(plan, initializers, inp)
    values = inp.value.view(-1, s.kv_heads, s.head_size).transpose(0, 1)
    assert critical.buffers.ring is None  # a fixed-mode server keeps no queries
    for layer in range(s.layers):
        recorded = critical.buffers.positions[layer][pages, :, offsets]  # [T, H]
        assert torch.equal(recorded, inp.positions.int().view(-1, 1).expand(-1, s.kv_heads))
        nu = critical.buffers.states["nu"][layer][pages, :, offsets]  # [T, H]
        torch.testing.assert_close(nu, dense.value_norms(values, kv.o_proj[layer]).T)
    wmass = critical.buffers.states["wmass"][0]
    before = paged.gather_tokens(wmass, kv.block_table[1:], context).sum(dim=-1)  # [R-1, H]
    critical.evict(plan, inp)
    after = paged.gather_tokens(wmass, kv.block_table[1:], context).sum(dim=-1)
    group = s.query_heads // s.kv_heads
    torch.testing.assert_close(after - before, torch.full_like(before, float(group)))

    step = bench.EvictionStep(kv, EvictionConfig.from_spec("keydiff", budget=budget).build_policy())
    step.reset(sc)
    plan, initializers = step.plan(sc, inp)
    step.record(plan, initializers, inp)
    keys = paged.gather_tokens(kv.k, kv.block_table[:1], context)
    lengths = torch.tensor([context])
    expected = dense.topk_keep(dense.keydiff_scores(keys, lengths), dense.valid_slots(lengths, context),
                               torch.tensor([budget]), budget)
    restore = step.snapshot(sc)
    raw, positions = kv.raw.clone(), step.buffers.positions.clone()
    (kept,) = step.evict(plan, inp)
    assert torch.equal(kept, expected)
    slots = torch.arange(context, dtype=torch.int32).expand(s.kv_heads, -1)
    after = paged.gather_tokens(step.buffers.positions[0], kv.block_table, context)  # [R, H, context]
    assert torch.equal(after[0, :, :budget].long(), expected[0])  # positions were slot indices
    assert torch.equal(after[1:], slots.expand(s.rows - 1, -1, -1))
    assert not torch.equal(kv.raw, raw)
    restore()
    assert torch.equal(kv.raw, raw) and torch.equal(step.buffers.positions, positions)
