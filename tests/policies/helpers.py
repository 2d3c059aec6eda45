"""Shared builders for the policy tests."""

from __future__ import annotations

import torch

from vllm_evict.policies.base import EvictionInputs, Phase, Policy


def make_inputs(h_kv: int, group: int, n: int, d: int, w: int, seed: int = 0,
                phase: Phase = Phase.PREFILL) -> EvictionInputs:
    """Random fp32 inputs for one (layer, sequence): n candidates at positions 0..n-1 (slot = position)
    in every one of ``h_kv`` KV heads, ``h_kv * group`` query heads with the queries of the last ``w``
    positions (the newest tokens, which are also this step's ``num_new``), scale 1/sqrt(d), and an
    output projection [H_q*d, H_q*d]. The state is empty: see ``with_initial_state``.
    """
    if not 0 <= w <= n:
        raise ValueError(f"need 0 <= w <= n, got w={w}, n={n}")
    gen = torch.Generator().manual_seed(seed)
    h_q = h_kv * group
    keys = torch.randn(h_kv, n, d, generator=gen)
    values = torch.randn(h_kv, n, d, generator=gen)
    queries = torch.randn(h_q, w, d, generator=gen)
    o_proj = torch.randn(h_q * d, h_q * d, generator=gen) / (h_q * d) ** 0.5
    positions = torch.arange(n, dtype=torch.int64).expand(h_kv, n).contiguous()
    query_positions = torch.arange(n - w, n, dtype=torch.int64)
    return EvictionInputs(keys=keys, values=values, positions=positions, queries=queries,
                          query_positions=query_positions, scale=d ** -0.5, seq_len=n, num_new=w,
                          phase=phase, state={}, layer=0, seed=seed, o_proj=o_proj)


def with_initial_state(policy: Policy, inp: EvictionInputs) -> EvictionInputs:
    """The inputs with the state every candidate would have had on entering the cache."""
    return inp.with_state(policy.init_state(inp.keys, inp.values, inp.o_proj))


def window_for(policy: Policy, n: int, num_new: int) -> int:
    """How many queries the engine hands ``policy`` when it holds n candidates, num_new of them new."""
    w = policy.query_window
    if w is None:
        return num_new
    return min(w, n)


def naive_attention_rows(keys: torch.Tensor, positions: torch.Tensor, queries: torch.Tensor,
                         query_positions: torch.Tensor, scale: float) -> torch.Tensor:
    """Causal softmax rows written out head by head and query by query, in float64: [H_q, w, n].

    Deliberately independent of ``attention.py``: explicit exp / sum over the visible keys only.
    """
    h_kv, n, _ = keys.shape
    h_q, w, _ = queries.shape
    group = h_q // h_kv
    out = torch.zeros(h_q, w, n, dtype=torch.float64)
    for g in range(h_q):
        h = g // group
        for i in range(w):
            visible = [j for j in range(n) if int(positions[h, j]) <= int(query_positions[i])]
            if not visible:
                continue
            logits = {j: scale * float(queries[g, i].double() @ keys[h, j].double()) for j in visible}
            top = max(logits.values())
            weights = {j: float(torch.tensor(logits[j] - top, dtype=torch.float64).exp()) for j in visible}
            total = sum(weights.values())
            for j in visible:
                out[g, i, j] = weights[j] / total
    return out


def group_mean(per_query_head: torch.Tensor, h_kv: int) -> torch.Tensor:
    """[H_q, ...] -> [H_kv, ...]: mean over the query heads of each KV head's group."""
    h_q = per_query_head.shape[0]
    return per_query_head.reshape(h_kv, h_q // h_kv, *per_query_head.shape[1:]).mean(dim=1)
