"""Head by head against NVIDIA kvpress (0.5.5): the same prompts, model (SmolLM2-135M-Instruct, float32),
budget and settings, one-shot after the whole prompt in one chunk.

SnapKV, StreamingLLM, TOVA and CriticalKV over SnapKV must keep identical sets in every (layer, KV head);
KeyDiff and key-norm identical up to float ties (``disagreements_outside_ties``). How kvpress is driven:
tests/parity/kvpress_harness.py. Settings on both sides:

=================  =========================================  ===================================================
ours               options                                    kvpress
=================  =========================================  ===================================================
snapkv             window 32, kernel 7, pooling avg           SnapKVPress(window_size=32, kernel_size=7)
streamingllm       sinks 4                                    StreamingLLMPress(n_sink=4)
tova               recent 1 (heads layer, the default)        TOVAPress() - it always keeps the last token
criticalkv+snapkv  alpha 0.5, epsilon 1e-4, snapkv as above   CriticalKVPress(SnapKVPress(32, 7), 1e-4, 0.5)
keydiff            -                                          KeyDiffPress()
knorm              -                                          KnormPress()
=================  =========================================  ===================================================

About 65 s of CPU on one thread (3 prompts: one kvpress forward serves all six presses, then one reference
run per method; plus one run through kvpress's own hooks and one TOVA run with heads="group"); 3 to 6 min
wall on a 2-core machine shared with other jobs. Measured tie swaps: none for KeyDiff; 4, 5 and 1 pairs for
key-norm, all between exactly equal kvpress scores.
"""

from __future__ import annotations

from typing import Any, Callable

import pytest
import torch

from tests.parity import kvpress_harness as harness
from tests.parity.prompts import parity_prompts

from kvpress import CriticalKVPress, KeyDiffPress, KnormPress, SnapKVPress, StreamingLLMPress, TOVAPress

# prompt -> budget (tokens kept per layer and KV head); 537, 388 and 312 prompt tokens.
BUDGETS = {"passkey": 128, "lighthouses-chat": 96, "code-review": 160}
SNAPKV = {"window": 32, "kernel": 7, "pooling": "avg"}
# name -> (our spec, our options, kvpress press factory)
METHODS: dict[str, tuple[str, dict[str, Any], Callable[[], Any]]] = {
    "snapkv": ("snapkv", SNAPKV, lambda: SnapKVPress(window_size=32, kernel_size=7)),
    "streamingllm": ("streamingllm", {"sinks": 4}, lambda: StreamingLLMPress(n_sink=4)),
    "tova": ("tova", {"recent": 1}, lambda: TOVAPress()),
    "criticalkv+snapkv": ("criticalkv+snapkv", {**SNAPKV, "alpha": 0.5, "epsilon": 1e-4},
                          lambda: CriticalKVPress(SnapKVPress(window_size=32, kernel_size=7), epsilon=1e-4,
                                                  first_stage_ratio=0.5)),
    "keydiff": ("keydiff", {}, lambda: KeyDiffPress()),
    "knorm": ("knorm", {}, lambda: KnormPress()),
}
IDENTICAL = ("snapkv", "streamingllm", "tova", "criticalkv+snapkv")
WITHIN_TIES = ("keydiff", "knorm")
# Float ties: reference scores within this fraction of the head's largest |score| of the cut-off.
TIE_RTOL = 1e-5


@pytest.fixture(scope="module")
def model_and_prompts(smollm2_path, one_intra_op_thread):
    # One intra-op thread: on 2 shared cores a second OpenMP thread made these small forwards slower.
    from vllm_evict.reference import load_model

    model, tokenizer = load_model(smollm2_path, dtype=torch.float32)
    return model, parity_prompts(tokenizer)


@pytest.fixture(scope="module")
def press_runs(model_and_prompts):
    """prompt -> method -> PressRun, computed on first use (one forward per prompt)."""
    model, prompts = model_and_prompts
    cache: dict[str, dict[str, harness.PressRun]] = {}

    def get(prompt: str) -> dict[str, harness.PressRun]:
        if prompt not in cache:
            presses = {name: make for name, (_, _, make) in METHODS.items()}
            cache[prompt] = harness.run_presses(model, prompts[prompt], BUDGETS[prompt], presses)
        return cache[prompt]

    return get


def ours(model_and_prompts, prompt: str, method: str, **extra: Any) -> list[torch.Tensor]:
    model, prompts = model_and_prompts
    spec, options, _ = METHODS[method]
    return harness.our_kept(model, prompts[prompt], spec, BUDGETS[prompt], {**options, **extra})


def mismatched_heads(got: list[torch.Tensor], want: dict[int, torch.Tensor]) -> dict[tuple[int, int], list[int]]:
    """(layer, head) -> positions kept by one side only, for every head whose kept set differs."""
    assert sorted(want) == list(range(len(got)))
    out = {}
    for layer, kept in enumerate(got):
        for head in range(kept.shape[0]):
            if not torch.equal(kept[head], want[layer][head]):
                out[(layer, head)] = sorted(set(kept[head].tolist()) ^ set(want[layer][head].tolist()))
    return out


@pytest.mark.parametrize("prompt", list(BUDGETS))
@pytest.mark.parametrize("method", IDENTICAL)
def test_identical_kept_sets(model_and_prompts, press_runs, prompt, method):
    reference = press_runs(prompt)[method]
    got = ours(model_and_prompts, prompt, method)
    mismatched = mismatched_heads(got, reference.kept)
    heads = len(got) * got[0].shape[0]
    assert not mismatched, (f"{method} on {prompt}: {len(mismatched)}/{heads} (layer, head) keep other tokens "
                            f"than kvpress (positions kept by one side only): {mismatched}")


@pytest.mark.parametrize("prompt", list(BUDGETS))
@pytest.mark.parametrize("method", WITHIN_TIES)
def test_identical_up_to_float_ties(model_and_prompts, press_runs, prompt, method):
    reference = press_runs(prompt)[method]
    got = ours(model_and_prompts, prompt, method)
    outside, swaps = {}, 0
    for layer, kept in enumerate(got):
        for head in range(kept.shape[0]):
            want = reference.kept[layer][head]
            bad = harness.disagreements_outside_ties(kept[head], want, reference.scores[layer][head], TIE_RTOL)
            if bad:
                outside[(layer, head)] = bad
            swaps += len(set(kept[head].tolist()) - set(want.tolist()))
    print(f"{method} on {prompt}: {swaps} tie swaps in all heads")
    assert not outside, f"{method} on {prompt}: disagreements that are not float ties: {outside}"


def test_kvpress_keeps_the_top_of_its_own_scores(press_runs):
    """The harness reads kvpress right: what a press left in the cache is a top-k of its own scores."""
    prompt = "code-review"
    for method, run in press_runs(prompt).items():
        for layer, kept in run.kept.items():
            for head in range(kept.shape[0]):
                scores = run.scores[layer][head]
                dropped = torch.ones_like(scores, dtype=torch.bool)
                dropped[kept[head]] = False
                assert kept.shape[1] == BUDGETS[prompt]
                assert scores[kept[head]].min() >= scores[dropped].max(), (method, layer, head)


def test_press_through_its_own_hooks_keeps_the_same(model_and_prompts, press_runs):
    """kvpress's ordinary path (``with press(model)``, its forward hook writing the pruned cache) keeps what
    the harness's direct ``compress`` call reads, so the one-forward shortcut changes nothing."""
    model, prompts = model_and_prompts
    prompt = "code-review"
    through_hooks = harness.kept_through_press_hooks(model, prompts[prompt], BUDGETS[prompt],
                                                     SnapKVPress(window_size=32, kernel_size=7))
    assert not mismatched_heads([through_hooks[i] for i in sorted(through_hooks)], press_runs(prompt)["snapkv"].kept)


def test_tova_group_mean_is_not_what_kvpress_keeps(model_and_prompts, press_runs):
    """The comparison can tell the two TOVA readings apart: the GQA-group mean (heads="group") keeps other
    tokens than kvpress's layer-wide mean in most heads, while the default keeps the same (above)."""
    prompt = "code-review"
    got = ours(model_and_prompts, prompt, "tova", heads="group")
    mismatched = mismatched_heads(got, press_runs(prompt)["tova"].kept)
    assert len(mismatched) > len(got) * got[0].shape[0] // 2, len(mismatched)


# ---- the tie rule itself, on hand-made scores ------------------------------------------------------------

SCORES = torch.tensor([5.0, 4.0, 3.0, 3.0 + 1e-6, 2.0, 1.0])  # 2 and 3 tie within 1e-5 * max|score|


def test_a_swap_between_tied_scores_is_allowed():
    # Budget 3: the cut-off is position 3's score; position 2 is 1e-6 below it.
    assert harness.disagreements_outside_ties(torch.tensor([0, 1, 2]), torch.tensor([0, 1, 3]), SCORES, 1e-5) == []


def test_a_swap_with_a_clearly_lower_score_is_reported():
    # Keeping 4 (score 2.0) instead of 3: 3 is at the cut-off, 4 is 1.0 below it.
    assert harness.disagreements_outside_ties(torch.tensor([0, 1, 4]), torch.tensor([0, 1, 3]), SCORES, 1e-5) == [4]
    # With a tolerance below the 1e-6 gap, the same swap of 2 for 3 is no longer a tie.
    assert harness.disagreements_outside_ties(torch.tensor([0, 1, 2]), torch.tensor([0, 1, 3]), SCORES, 1e-9) == [2]


def test_kept_counts_must_match():
    with pytest.raises(AssertionError, match="ours keeps 2 tokens, the reference 3"):
        harness.disagreements_outside_ties(torch.tensor([0, 1]), torch.tensor([0, 1, 3]), SCORES, 1e-5)


def test_positions_of_matches_each_key_once():
    cache = torch.arange(24, dtype=torch.float32).view(1, 6, 4)
    assert harness.positions_of(cache[:, [4, 1, 2]], cache).tolist() == [[1, 2, 4]]
    with pytest.raises(AssertionError, match="matching 0 or several"):
        harness.positions_of(cache[:, [1]] + 0.5, cache)


def test_compression_ratio_keeps_exactly_the_budget():
    for n in (100, 312, 388, 537, 4096):
        for budget in (1, 63, 64, 65, 96, n - 1):
            ratio = harness.compression_ratio_for(budget, n, first_stage_ratio=0.5)
            assert harness.compute_n_kept(n, ratio) == budget  # kvpress's own rule
    with pytest.raises(ValueError, match="budget must be in 1..99 for a 100-token prompt, got 100"):
        harness.compression_ratio_for(100, 100)
