"""Tensor parallelism: TP 2 keeps, per layer and *global* KV head, exactly the logical positions TP 1
keeps, and generates the same greedy tokens (logprobs within float tolerance: the row-parallel layers
sum in another order).

Two tiny random Llamas: 4 KV heads (each rank holds 2 whole GQA groups) and 1 KV head (replicated on
both ranks, each holding half of the group's query heads). Each model runs once with TP 1 (in process)
and once with TP 2 (multiprocess executor, one worker process per rank), with one request per method,
all in one batch; every test below reads those two runs.

On the 1-KV-head model each rank holds half of the query-head group: methods that read queries (and
CriticalKV's value norms) complete their sums over the group across the two copies with one all-reduce
(vllm_evict/kv_shard.py); random and NaCl draw per global KV head.
"""

from __future__ import annotations

import pytest

from tests.scaleout.helpers import BUDGET, KV_HEADS, POLICIES, PROMPT_LEN, kept_differences, page_bound_violations
from vllm_evict.config import EvictionConfig

pytestmark = [pytest.mark.engine, pytest.mark.tp]


@pytest.mark.parametrize("model,spec", [pytest.param(model, spec, id=f"{model}-{spec}")
                                        for model in KV_HEADS for spec in POLICIES])
def test_tp2_keeps_what_tp1_keeps(tp_outcomes, model, spec):
    single, double = tp_outcomes(model, 1)[spec], tp_outcomes(model, 2)[spec]
    heads = KV_HEADS[model]
    for layer in double.kept:
        assert sorted(layer) == list(range(heads))
        copies = max(1, 2 // heads)  # ranks holding one global head
        assert all(len(c) == copies for c in layer.values()), "each global head is reported by every rank holding it"
    problems = kept_differences(double, single)
    assert not problems, f"{model} {spec}, TP 2 vs TP 1:\n" + "\n".join(problems[:8])
    assert double.tokens == single.tokens
    assert double.logprobs == pytest.approx(single.logprobs, abs=1e-4)


@pytest.mark.parametrize("model", list(KV_HEADS))
def test_tp2_pages_stay_bounded(tp_outcomes, model):
    """Every rank compacts to the scheduler's count, so one page table serves both: the bounds hold,
    and (checked in ``tp_outcomes``) the pool is full after the drain."""
    for spec, outcome in tp_outcomes(model, 2).items():
        config = EvictionConfig.from_spec(spec, BUDGET)
        problems = page_bound_violations(outcome, prompt_len=PROMPT_LEN, config=config)
        assert not problems, f"{spec}: " + "; ".join(problems[:4])
        final = {len(positions) for layer in outcome.kept for copies in layer.values() for positions in copies}
        assert len(final) == 1 and BUDGET <= final.pop() <= BUDGET + 32, f"{spec}: kept counts differ across heads"


@pytest.mark.parametrize("tp_size,total,local,want", [
    (2, 4, 2, [[0, 1], [2, 3]]),  # whole groups per rank
    (2, 1, 1, [[0], [0]]),  # one head on both ranks
    (4, 2, 1, [[0], [0], [1], [1]]),  # each head on two consecutive ranks
    (8, 8, 1, [[h] for h in range(8)]),
])
def test_global_kv_heads_follow_vllm_sharding(tp_size, total, local, want):
    from vllm_evict.engine.debug import global_kv_heads

    assert [global_kv_heads(rank, tp_size, total, local) for rank in range(tp_size)] == want
