"""Window pages on the real engine (engine/window_pages.py, engine/window_lender.py): pages the scheduler
lends a decoding request for its window's queries are taken back the moment another request needs them,
the queries they held still count, nobody waits for them, and nothing of it waits for the device."""

from __future__ import annotations

from typing import Any

import pytest
import torch

from tests.engine.helpers import BLOCK, greedy, token_prompt
from tests.engine.test_step_syncs import AuditedRunner
from vllm_evict import EvictionConfig
from vllm_evict.reference import load_model, run_reference

pytestmark = pytest.mark.engine

# Budget 64 + slack 8 with a window of 16: every decode step of A is inside a window (and one page is
# lent for it: 16 queries x 2 query heads per KV head = 32 slots of a 32-token page's 64).
SERVER = {"policy": "snapkv", "budget": 64, "window": 16, "slack": 8}
PROMPT_A, NEW_A, ARRIVAL = 100, 40, 68  # B arrives when A holds 68 tokens: 4 queries into a window


def run(engine: Any) -> dict[str, Any]:
    """A decodes alone; when it holds ARRIVAL tokens, B (no eviction) arrives with a prompt that fits only
    in every page A does not hold, a lent one included. Returns what happened."""
    llm_engine, scheduler = engine.llm.llm_engine, engine.scheduler
    engine.runner.evict_kept_record = {}
    llm_engine.add_request("A", token_prompt(PROMPT_A, 5), greedy(NEW_A))
    outputs, step, arrived, admitted, lent_at_arrival = {}, 0, None, None, None
    preempted = set()
    while llm_engine.has_unfinished_requests():
        for out in llm_engine.step():
            if out.finished:
                outputs[out.request_id] = out
        step += 1
        ids = {r.rsplit("-", 1)[0]: r for r in scheduler.requests}
        preempted |= {name for name, r in ids.items() if scheduler.requests[r].num_preemptions}
        if arrived is None and "A" in ids and scheduler.num_cached_tokens(ids["A"]) == ARRIVAL:
            held = engine.pages_of(ids["A"])
            lent_at_arrival = len(scheduler.window_pages.lent.get(ids["A"], ()))
            # B needs every page A does not hold (its 8 new tokens fit in its last page).
            prompt_b = BLOCK * (engine.total_pages() - held) - 8
            llm_engine.add_request("B", token_prompt(prompt_b, 9), greedy(8, kv_eviction="none"))
            arrived = step
        elif arrived is not None and admitted is None and "B" in ids and scheduler.requests[ids["B"]].num_computed_tokens:
            admitted = step
    engine.llm.generate([token_prompt(3)], greedy(1, kv_eviction="none"))  # delivers the last finishes
    kept = next(k for r, k in engine.runner.evict_kept_record.items() if r.startswith("A-"))
    return {"outputs": outputs, "arrived": arrived, "admitted": admitted, "preempted": preempted,
            "lent_at_arrival": lent_at_arrival, "kept": [torch.sort(layer, dim=-1).values for layer in kept]}


def test_pages_taken_back_mid_window_keep_the_reference_tokens_and_delay_nobody(tiny_llama, engine_factory,
                                                                                 monkeypatch):
    lending = engine_factory(tiny_llama, SERVER, pages=14, max_model_len=352)
    audited = AuditedRunner(lending)  # everything the worker does for eviction, the pages' return included
    try:
        with_loans = run(lending)
    finally:
        audited.restore()
    lender = lending.scheduler.window_pages
    assert with_loans["lent_at_arrival"] == 1 and lender.reclaims >= 1, (with_loans, lender.reclaims)
    assert not lender.lent and lending.free_pages() == lending.total_pages()
    assert audited.calls["window_returns"] >= 1 and audited.audit.ops_seen > 100
    violations = sorted({str(v) for v in audited.audit.violations})
    assert not violations, "host-device synchronisations:\n" + "\n".join(violations)

    monkeypatch.setenv("VLLM_EVICT_WINDOW_PAGES", "0")
    plain = engine_factory(tiny_llama, SERVER, pages=14, max_model_len=352)
    without = run(plain)
    assert plain.scheduler.window_pages.loans == 0 and without["lent_at_arrival"] == 0
    # B is admitted in the step it would be without loans (the one it arrived in), and nobody is preempted.
    assert with_loans["arrived"] == without["arrived"] and with_loans["admitted"] == without["admitted"]
    assert with_loans["admitted"] == with_loans["arrived"] + 1
    assert not with_loans["preempted"] and not without["preempted"]

    # A keeps what the reference keeps replaying it alone: the mass of the window's queries that waited in
    # the page taken back was added before B's prompt overwrote it.
    config = EvictionConfig.from_mapping(SERVER)
    model, _ = load_model(tiny_llama, dtype=torch.float32)
    reference = run_reference(model, token_prompt(PROMPT_A, 5)["prompt_token_ids"], config, max_new_tokens=NEW_A,
                              chunk_size=64, ignore_eos=True)
    for got in (with_loans, without):
        assert list(got["outputs"]["A"].outputs[0].token_ids) == reference.token_ids
        mismatched = [layer for layer, (kept, want) in enumerate(zip(got["kept"], reference.kept_positions))
                      if not torch.equal(kept.cpu(), want.to(kept.dtype))]
        assert not mismatched, f"layers whose kept tokens differ: {mismatched}"
