"""The HF reference runner on SmolLM2 (fp32): exactness without eviction, every policy with eviction,
determinism."""

from __future__ import annotations

import pytest
import torch

from vllm_evict import reference
from vllm_evict.config import EvictionConfig
from vllm_evict.policies import BASE_POLICIES, META_POLICIES, load_class

BUDGET = 64
CHUNK = 32
NEW_TOKENS = 4

TEXT = ("The Roman Empire was the post-Republican state of ancient Rome. It included large territorial "
        "holdings around the Mediterranean Sea in Europe, North Africa, and Western Asia, and was ruled by "
        "emperors. The pass key is 71432. Remember it. From the accession of Caesar Augustus as the first "
        "Roman emperor to the military anarchy of the 3rd century, it was a Principate with Italia as the "
        "metropole of its provinces and the city of Rome as its sole capital. The Empire was later ruled by "
        "multiple emperors who shared control over the Western Roman Empire and the Eastern Roman Empire. "
        "The city of Rome remained the nominal capital of both parts until AD 476. What is the pass key?")


@pytest.fixture(scope="module")
def smollm2(smollm2_path, one_intra_op_thread):
    # Tiny matmuls: one_intra_op_thread keeps a second spinning OpenMP thread from slowing them ~10x.
    return reference.load_model(smollm2_path, dtype=torch.float32)


@pytest.fixture(scope="module")
def prompt(smollm2):
    ids = reference.prompt_token_ids(smollm2[1], TEXT)
    assert 130 <= len(ids) <= 260, len(ids)
    return ids


def _specs() -> list[str]:
    specs = list(BASE_POLICIES)
    specs += [f"{meta}+snapkv" for meta in META_POLICIES]
    return specs


def _options(spec: str) -> dict:
    """Options that exercise protected tokens: a few sinks and a recent window wherever accepted."""
    meta, _, base = spec.rpartition("+")
    accepted = set(load_class(base).defaults) | (set(load_class(meta).defaults) if meta else set())
    options = {}
    if "sinks" in accepted:
        options["sinks"] = 4
    if "recent" in accepted:
        options["recent"] = 8
    if "window" in accepted:
        options["window"] = 16
    return options


def _protected_positions(config: EvictionConfig, seq_len: int) -> torch.Tensor:
    """Logical positions every head must still hold after the final (decode) eviction."""
    opts = dict(config.options)
    recent = int(opts.get("window", opts.get("recent", 0)) or 0)
    sinks = int(opts.get("sinks", 0) or 0)
    return torch.cat([torch.arange(min(sinks, seq_len)), torch.arange(seq_len - recent, seq_len)]).unique()


def _manual_greedy(model, prompt_ids, steps):
    """Plain HF greedy decoding (eager attention, HF's own cache, mask and positions), for comparison."""
    from transformers import DynamicCache

    model.set_attn_implementation("eager")
    tokens, logprobs = [], []
    try:
        with torch.inference_mode():
            cache = DynamicCache(config=model.config)
            ids = torch.tensor([prompt_ids])
            for _ in range(steps):
                logits = model(input_ids=ids, past_key_values=cache, use_cache=True).logits[0, -1]
                logp = torch.log_softmax(logits.float(), -1)
                tokens.append(int(logp.argmax()))
                logprobs.append(float(logp[tokens[-1]]))
                ids = torch.tensor([[tokens[-1]]])
    finally:
        model.set_attn_implementation(reference.ATTN_IMPLEMENTATION)
    return tokens, logprobs


@pytest.mark.parametrize("spec", [None, "snapkv", "h2o"])
def test_no_eviction_matches_plain_hf(smollm2, prompt, spec):
    model, tokenizer = smollm2
    steps = 6
    expected_tokens, expected_logprobs = _manual_greedy(model, prompt, steps)
    # A budget above prompt + generation: the policy runs but never evicts.
    config = None if spec is None else EvictionConfig.from_spec(spec, len(prompt) + steps + 1)
    result = reference.run_reference(model, prompt, config, steps, chunk_size=CHUNK, tokenizer=tokenizer,
                                     ignore_eos=True)
    assert result.token_ids == expected_tokens
    assert max(abs(a - b) for a, b in zip(result.logprobs, expected_logprobs)) < 1e-4
    assert result.trace == []
    seq_len = len(prompt) + steps - 1
    for kept in result.kept_positions:
        assert kept.shape == (3, seq_len)
        assert torch.equal(kept, torch.arange(seq_len).expand(3, seq_len))
    assert result.text == tokenizer.decode(expected_tokens, skip_special_tokens=True)


def test_chunk_size_does_not_change_plain_generation(smollm2, prompt):
    model, _ = smollm2
    a = reference.run_reference(model, prompt, None, 3, chunk_size=len(prompt), ignore_eos=True)
    b = reference.run_reference(model, prompt, None, 3, chunk_size=17, ignore_eos=True)
    assert a.token_ids == b.token_ids
    assert max(abs(x - y) for x, y in zip(a.logprobs, b.logprobs)) < 1e-4


@pytest.mark.parametrize("spec", _specs())
def test_every_policy_evicts_to_budget(smollm2, prompt, spec):
    model, tokenizer = smollm2
    config = EvictionConfig.from_spec(spec, BUDGET, slack=1, **_options(spec))
    result = reference.run_reference(model, prompt, config, NEW_TOKENS, chunk_size=CHUNK, tokenizer=tokenizer,
                                     ignore_eos=True)
    assert len(result.token_ids) == NEW_TOKENS and len(result.logprobs) == NEW_TOKENS
    assert all(lp <= 0.0 for lp in result.logprobs)
    assert isinstance(result.text, str) and result.text
    seq_len = len(prompt) + NEW_TOKENS - 1
    protected = _protected_positions(config, seq_len)
    assert len(result.kept_positions) == model.config.num_hidden_layers
    for kept in result.kept_positions:
        # slack 1: every decode step evicts back to the budget, so exactly `budget` survive.
        assert kept.shape == (3, BUDGET)
        assert bool((kept[:, 1:] > kept[:, :-1]).all())  # distinct positions
        assert int(kept.min()) >= 0 and int(kept.max()) < seq_len
        assert bool(torch.isin(protected, kept[0]).all() and torch.isin(protected, kept[1]).all()
                    and torch.isin(protected, kept[2]).all()), (spec, protected, kept)
    assert result.trace, "no eviction happened"
    assert all(ev.kept == BUDGET for ev in result.trace)
    if config.schedule == "oneshot":
        assert all(ev.phase.value != "prefill" for ev in result.trace)
    else:
        assert any(ev.phase.value == "prefill" for ev in result.trace)
    if spec == "streamingllm":  # sinks + the most recent tokens, nothing else
        expected = torch.cat([torch.arange(4), torch.arange(seq_len - (BUDGET - 4), seq_len)])
        assert all(torch.equal(k, expected.expand(3, BUDGET)) for k in result.kept_positions)


def test_eviction_changes_attention(smollm2, prompt):
    """Eviction must reach the model: a tiny budget changes the logprobs."""
    model, _ = smollm2
    plain = reference.run_reference(model, prompt, None, 2, chunk_size=CHUNK, ignore_eos=True)
    config = EvictionConfig.from_spec("streamingllm", 8, sinks=4)
    evicted = reference.run_reference(model, prompt, config, 2, chunk_size=CHUNK, ignore_eos=True)
    assert abs(plain.logprobs[0] - evicted.logprobs[0]) > 1e-3 or plain.token_ids != evicted.token_ids


def test_decode_slack(smollm2, prompt):
    model, _ = smollm2
    config = EvictionConfig.from_spec("tova", BUDGET, slack=4)
    steps = 7
    result = reference.run_reference(model, prompt, config, steps, chunk_size=CHUNK, ignore_eos=True)
    decode = [ev for ev in result.trace if ev.phase.value == "decode"]
    assert decode and all(ev.phys_before == BUDGET + 4 for ev in decode)
    # 6 decode forwards from a cache of `budget`: grows to budget+4, evicts, then +2.
    assert all(k.shape == (3, BUDGET + 2) for k in result.kept_positions)


@pytest.mark.parametrize("spec", ["snapkv", "random", "caote+snapkv"])
def test_deterministic(smollm2, prompt, spec):
    model, _ = smollm2
    config = EvictionConfig.from_spec(spec, BUDGET, seed=3)
    a = reference.run_reference(model, prompt, config, 3, chunk_size=CHUNK, ignore_eos=True)
    b = reference.run_reference(model, prompt, config, 3, chunk_size=CHUNK, ignore_eos=True)
    assert a.token_ids == b.token_ids
    assert a.logprobs == b.logprobs
    assert all(torch.equal(x, y) for x, y in zip(a.kept_positions, b.kept_positions))


def test_streamingllm_matches_masked_full_forward(smollm2, prompt):
    """An independent oracle for positions and compaction: StreamingLLM's survivors are known in advance
    (the sinks plus the most recent tokens), so one plain-HF eager forward over the whole sequence with a
    4D mask that hides, from every query, the tokens evicted before its step must give the same logprobs.
    This catches wrong RoPE positions (they must stay logical), wrong masks and wrong compaction."""
    model, _ = smollm2
    budget, sinks, steps = 48, 4, 4
    config = EvictionConfig.from_spec("streamingllm", budget, sinks=sinks)
    result = reference.run_reference(model, prompt, config, steps, chunk_size=CHUNK, ignore_eos=True)
    seq = prompt + result.token_ids[:-1]
    n, p = len(seq), len(prompt)
    i = torch.arange(n)
    before = torch.where(i < p, (i // CHUNK) * CHUNK, i)  # logical tokens cached before query i's step
    j = torch.arange(n).view(1, n)
    kept_earlier = (before.view(n, 1) <= budget) | (j < sinks) | (j >= before.view(n, 1) - (budget - sinks))
    visible = (j <= i.view(n, 1)) & ((j >= before.view(n, 1)) | kept_earlier)
    mask = torch.zeros(n, n).masked_fill(~visible, torch.finfo(torch.float32).min).view(1, 1, n, n)
    model.set_attn_implementation("eager")
    try:
        with torch.inference_mode():
            logits = model(input_ids=torch.tensor([seq]), attention_mask=mask, use_cache=False).logits[0]
    finally:
        model.set_attn_implementation(reference.ATTN_IMPLEMENTATION)
    logp = torch.log_softmax(logits[p - 1:].float(), dim=-1)
    assert logp.argmax(-1).tolist() == result.token_ids
    expected = logp.gather(1, torch.tensor(result.token_ids).view(-1, 1)).view(-1)
    assert torch.allclose(expected, torch.tensor(result.logprobs), atol=1e-4), (expected, result.logprobs)
    # and eviction did matter: the full-cache logprobs differ
    plain = reference.run_reference(model, prompt, None, steps, chunk_size=CHUNK, ignore_eos=True)
    assert max(abs(a - b) for a, b in zip(plain.logprobs, result.logprobs)) > 1e-3
