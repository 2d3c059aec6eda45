"""The quality suite's runners on SmolLM2-135M-Instruct (float32), a 512-token passkey sample: the engine
runner in both settings, its realised-ratio accounting, and kvpress on the same sample. The engine
(``llm``, tests/quality/conftest.py) is shared with test_kept_tokens.py.

About 30 s of CPU (engine start-up included) on a quiet 2-core machine."""

from __future__ import annotations

from typing import Any

import pytest
import torch

from benchmarks.quality import engine_runner as E
from benchmarks.quality import kvpress_runner as K
from benchmarks.quality import methods as M
from benchmarks.quality import prompts as P

pytestmark = [pytest.mark.engine]

RATIO = 0.5


@pytest.fixture(scope="module")
def prompt(llm) -> P.Prompt:
    return P.fit(llm.get_tokenizer(), "passkey", 512, 0)


@pytest.fixture(scope="module")
def engine_records(llm, prompt, smollm2_path) -> dict[tuple[str, str, float], dict[str, Any]]:
    requests = [E.requests_for(prompt, setting, method, ratio)
                for setting in M.SETTINGS
                for method, ratio in ((M.FULL, 0.0), (M.ALL_METHODS["snapkv"], RATIO), (M.ALL_METHODS["keydiff"], 0.75))]
    requests.append(E.requests_for(prompt, "aware", M.ALL_METHODS["snapkv"], 0.96))  # budget 19 < window 32
    records = E.run(llm, requests, E.eos_ids(llm.get_tokenizer(), str(smollm2_path)), use_tqdm=False)
    return {(r["setting"], r["method"], r["ratio"]): r for r in records}


def test_full_cache_finds_the_pass_key_in_both_settings(engine_records, prompt):
    aware, agnostic = engine_records[("aware", "full", 0.0)], engine_records[("agnostic", "full", 0.0)]
    assert aware["score"] == 1.0 and prompt.sample.answers[0] in aware["answer"]
    # The question forced after the context is the same tokens as the question in the prompt: same answer.
    assert agnostic["answer"] == aware["answer"]
    assert aware["realised_ratio"] == agnostic["realised_ratio"] == 0.0
    assert aware["stats"]["policy"] == "none" and aware["stats"]["tokens_evicted"] == 0


@pytest.mark.parametrize("setting", M.SETTINGS)
@pytest.mark.parametrize("method,ratio", [("snapkv", RATIO), ("keydiff", 0.75)])
def test_budget_and_realised_ratio(engine_records, prompt, setting, method, ratio):
    r = engine_records[(setting, method, ratio)]
    span = prompt.num_tokens if setting == "aware" else len(prompt.context_ids)
    budget = int(span * (1 - ratio))
    assert r["error"] is None and r["span_tokens"] == span and r["budget"] == budget
    stats = r["stats"]
    assert stats["policy"] == method and stats["budget"] == budget
    # Everything evicted came out of the span (nothing while decoding: the slack is above the answer).
    assert stats["tokens_evicted"] == span - budget
    assert r["realised_ratio"] == pytest.approx((span - budget) / span)
    assert abs(r["realised_ratio"] - ratio) < 2 / span
    if setting == "agnostic":
        # The question's tokens joined the evicted context uncompressed: the final cache holds the budget,
        # the question and the answer so far (the last sampled token is not cached yet).
        assert stats["tokens_cached"] == budget + len(prompt.question_ids) + r["answer_tokens"] - 1
    else:
        assert stats["tokens_cached"] == budget + r["answer_tokens"] - 1


def test_refused_settings_are_recorded_not_run(engine_records):
    r = engine_records[("aware", "snapkv", 0.96)]
    assert r["answer"] is None and r["score"] is None and r["realised_ratio"] is None
    assert "must be larger than the 32 tokens snapkv always keeps" in r["error"]


@pytest.fixture(scope="module")
def kvpress_records(smollm2_path, prompt) -> dict[tuple[str, str, float], dict[str, Any]]:
    model, tokenizer = K.load(str(smollm2_path), torch.float32)
    eos = E.eos_ids(tokenizer, str(smollm2_path))
    snapkv = {"snapkv": M.presses()["snapkv"]}
    out = {}
    for setting in M.SETTINGS:
        for r in K.run(model, tokenizer, prompt, setting, snapkv, [RATIO], eos, True, {}):
            out[(setting, r["method"], r["ratio"])] = r
    return out


@pytest.mark.parametrize("setting", M.SETTINGS)
def test_kvpress_keeps_the_same_budget_and_answers_as_the_engine(kvpress_records, engine_records, setting):
    """SnapKV keeps the same tokens in both (tests/parity), so the greedy answers agree, in both settings:
    the engine's query-agnostic mode compresses what kvpress's does."""
    ours, theirs = engine_records[(setting, "snapkv", RATIO)], kvpress_records[(setting, "snapkv", RATIO)]
    assert theirs["kept"] == theirs["budget"] == ours["budget"]
    assert theirs["realised_ratio"] == pytest.approx(ours["realised_ratio"])
    assert theirs["answer"] == ours["answer"]
    assert kvpress_records[(setting, "full", 0.0)]["answer"] == engine_records[(setting, "full", 0.0)]["answer"]
