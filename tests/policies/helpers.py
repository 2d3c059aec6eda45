"""Shared builders for the policy tests.

The policy contract is batched (``vllm_evict/policies/base.py``): every tensor of ``EvictionInputs``
has a leading row axis R, candidates are padded to N slots and per-row numbers are [R] tensors. Most
tests are about one request: they build a 1-row batch (``one_row`` / ``make_inputs``), run it through
``step`` with an int budget and read row 0 of the results. ``stack_rows`` pads several such rows into
one batch, with junk in every padding slot, for the tests that check rows do not influence each other.
"""

from __future__ import annotations

from typing import Sequence

import torch
from torch import Tensor

from vllm_evict import dense
from vllm_evict.config import EvictionConfig
from vllm_evict.policies import BASE_POLICIES, META_POLICIES, load_class
from vllm_evict.policies.base import EvictionInputs, Phase, Policy, StepResult

# Every registered policy, and every meta score over every attention-mass base.
MASS_BASES = tuple(name for name in BASE_POLICIES if load_class(name).is_attention_mass)
SPECS = list(BASE_POLICIES) + [f"{meta}+{base}" for meta in META_POLICIES for base in MASS_BASES]
# Smaller protected windows than the paper defaults, so that budgets below short lengths are possible.
SMALL_OPTIONS: dict[str, dict] = {"snapkv": {"window": 4}, "ahakv": {"recent": 4}}


def options_for(spec: str) -> dict:
    return dict(SMALL_OPTIONS.get(spec.split("+")[-1], {}))


def build(spec: str, budget: int) -> Policy:
    """``spec`` with ``SMALL_OPTIONS``, configured for ``budget``."""
    return EvictionConfig.from_spec(spec, budget, **options_for(spec)).build_policy()


def one_row(keys: Tensor, values: Tensor, positions: Tensor, queries: Tensor, query_positions: Tensor,
            scale: float, seq_len: int, num_new: int, *, phase: Phase = Phase.PREFILL,
            state: dict[str, Tensor] | None = None, layer: int = 0, seed: int = 0, head_offset: int = 0,
            o_proj: Tensor | None = None) -> EvictionInputs:
    """A 1-row batch from one request's tensors: keys/values [H, n, d], positions [H, n], queries
    [H_q, w, d], query_positions [w], state {name: [H, n]}; every slot holds a candidate."""
    n = positions.shape[1]
    return EvictionInputs(
        keys=keys.unsqueeze(0), values=values.unsqueeze(0), positions=positions.long().unsqueeze(0),
        lengths=torch.tensor([n]), queries=queries.unsqueeze(0),
        query_positions=torch.as_tensor(query_positions).long().view(1, -1), scale=scale,
        seq_len=torch.tensor([int(seq_len)]), num_new=torch.tensor([int(num_new)]), phase=phase,
        state={k: v.unsqueeze(0) for k, v in (state or {}).items()}, layer=layer, seed=torch.tensor([seed]),
        head_offset=head_offset, o_proj=o_proj, max_seq_len=int(seq_len))


def make_inputs(h_kv: int, group: int, n: int, d: int, w: int, seed: int = 0,
                phase: Phase = Phase.PREFILL) -> EvictionInputs:
    """Random fp32 inputs for one (layer, sequence), as a 1-row batch: n candidates at positions 0..n-1
    (slot = position) in every one of ``h_kv`` KV heads, ``h_kv * group`` query heads with the queries
    of the last ``w`` positions (the newest tokens, which are also this step's ``num_new``), scale
    1/sqrt(d), and an output projection [H_q*d, H_q*d]. The state is empty: see ``with_initial_state``.
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
    return one_row(keys, values, positions, queries, query_positions, d ** -0.5, seq_len=n, num_new=w,
                   phase=phase, seed=seed, o_proj=o_proj)


def window_for(policy: Policy, n: int, num_new: int) -> int:
    """How many queries the engine hands ``policy`` when it holds n candidates, num_new of them new."""
    w = policy.query_window
    if w is None:
        return num_new
    return min(w, n)


def init_rows(policy: Policy, keys: Tensor, values: Tensor, o_proj: Tensor | None) -> dict[str, Tensor]:
    """``policy.init_state`` over batched K/V [R, H, N, d] (it takes one token axis [H, T, d], as the
    engine passes a step's tokens of any rows): {name: [R, H, N]}, the other states 0."""
    r, h, n, d = keys.shape
    flat = lambda x: x.permute(1, 0, 2, 3).reshape(h, r * n, d)  # noqa: E731
    computed = policy.init_state(flat(keys), flat(values), o_proj)
    state = {name: v.reshape(h, r, n).permute(1, 0, 2) for name, v in computed.items()}
    for name in policy.state_names:
        state.setdefault(name, torch.zeros(r, h, n, device=keys.device))
    return state


def with_initial_state(policy: Policy, inp: EvictionInputs) -> EvictionInputs:
    """The inputs with the state every candidate would have had on entering the cache."""
    return inp.with_state(init_rows(policy, inp.keys, inp.values, inp.o_proj))


def with_budget(inp: EvictionInputs, budget: int | Sequence[int] | Tensor | None) -> EvictionInputs:
    """The inputs with ``budget`` set for every row (an int), per row (a sequence), or unset (None)."""
    if budget is None:
        return inp.evolve(budget=None, budget_max=0)
    b = torch.as_tensor(budget, dtype=torch.int64).expand(inp.num_rows).clone()
    return inp.evolve(budget=b.to(inp.device), budget_max=int(b.max()))


def step(policy: Policy, inp: EvictionInputs, budget: int | Sequence[int] | None) -> StepResult:
    """``policy.step`` with ``budget`` (see ``with_budget``)."""
    return policy.step(with_budget(inp, budget))


def check_keep_layout(keep: Tensor, budget: Tensor, lengths: Tensor, width: int) -> None:
    """The ``dense.topk_keep`` layout: per row and head, budget[r] strictly ascending real slots, then
    the padding width N in the remaining columns."""
    rows, _, b = keep.shape
    assert keep.dtype == torch.int64 and b == int(budget.max()), (keep.dtype, keep.shape, budget)
    for r in range(rows):
        live, rest = keep[r, :, : int(budget[r])], keep[r, :, int(budget[r]):]
        assert (live >= 0).all() and (live < int(lengths[r])).all(), f"row {r} keeps a padding slot: {live}"
        assert (live[:, 1:] > live[:, :-1]).all(), f"row {r}: kept slots must be strictly ascending"
        assert (rest == width).all(), f"row {r}: columns beyond its budget must hold N = {width}"


# ---- batching ---------------------------------------------------------------------------------------
def _pad(x: Tensor, axis: int, size: int, junk: Tensor) -> Tensor:
    """``x`` padded along ``axis`` to ``size`` with entries taken from ``junk`` (same shape as the result)."""
    out = junk.clone().to(x.dtype)
    index = [slice(None)] * x.dim()
    index[axis] = slice(0, x.shape[axis])
    out[tuple(index)] = x
    return out


def stack_rows(rows: Sequence[EvictionInputs], width: int | None = None, window: int | None = None,
               junk_seed: int = 0, roll: bool = False) -> EvictionInputs:
    """One batch of the given 1-row inputs, padded to ``width`` candidate slots (default: the longest
    row + 3) and ``window`` query entries (default: the widest + 2).

    Every padding slot holds junk: large random keys, values and state, and random positions (also
    negative and beyond the row's queries), so that a policy that reads padding changes a real row's
    result. Padding query entries carry junk queries at position -1 (empty). ``roll`` rotates row r's
    window by r entries, as a ring buffer leaves it. The rows must agree on the layer, head offset,
    scale, phase and o_proj (a batch shares them)."""
    first = rows[0]
    for r in rows[1:]:
        assert (r.layer, r.head_offset, r.scale, r.phase) == (first.layer, first.head_offset, first.scale, first.phase)
        assert r.state.keys() == first.state.keys()
    n = width if width is not None else max(int(r.lengths[0]) for r in rows) + 3
    w = window if window is not None else max(r.queries.shape[2] for r in rows) + 2
    g = torch.Generator().manual_seed(junk_seed)
    h, d, h_q = first.num_kv_heads, first.keys.shape[-1], first.queries.shape[1]

    def junk(*shape: int, scale: float = 50.0) -> Tensor:
        return torch.randn(*shape, generator=g) * scale

    keys, values, positions, queries, qpos, state = [], [], [], [], [], {k: [] for k in first.state}
    for i, r in enumerate(rows):
        assert r.num_rows == 1 and int(r.lengths[0]) == r.width, "stack 1-row inputs without padding"
        keys.append(_pad(r.keys[0], 1, n, junk(h, n, d)))
        values.append(_pad(r.values[0], 1, n, junk(h, n, d)))
        positions.append(_pad(r.positions[0], 1, n, torch.randint(-3, 10_000, (h, n), generator=g)))
        shift = i if roll else 0
        queries.append(_pad(r.queries[0], 1, w, junk(h_q, w, d, scale=3.0)).roll(shift, dims=1))
        qpos.append(_pad(r.query_positions[0], 0, w, torch.full((w,), dense.EMPTY_QUERY)).roll(shift, dims=0))
        for k in state:
            state[k].append(_pad(r.state[k][0], 1, n, junk(h, n, scale=1e3)))
    return EvictionInputs(
        keys=torch.stack(keys), values=torch.stack(values), positions=torch.stack(positions),
        lengths=torch.cat([r.lengths for r in rows]), queries=torch.stack(queries), query_positions=torch.stack(qpos),
        scale=first.scale, seq_len=torch.cat([r.seq_len for r in rows]), num_new=torch.cat([r.num_new for r in rows]),
        phase=first.phase, state={k: torch.stack(v) for k, v in state.items()}, layer=first.layer,
        seed=torch.cat([torch.as_tensor(r.seed).view(1) for r in rows]), head_offset=first.head_offset,
        o_proj=first.o_proj, max_seq_len=max(r.max_seq_len for r in rows))


# ---- naive references -------------------------------------------------------------------------------
def naive_attention_rows(keys: Tensor, positions: Tensor, queries: Tensor, query_positions: Tensor,
                         scale: float) -> Tensor:
    """Causal softmax rows written out head by head and query by query, in float64: [H_q, w, n].

    One request: keys [H_kv, n, d], positions [H_kv, n], queries [H_q, w, d], query_positions [w].
    Deliberately independent of ``vllm_evict.dense``: explicit exp / sum over the visible keys only.
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


def naive_rows_of(inp: EvictionInputs, row: int = 0) -> Tensor:
    """``naive_attention_rows`` of one row of a batch (its real slots and non-empty queries): [H_q, w, n]."""
    n = int(inp.lengths[row])
    live = inp.query_positions[row] >= 0
    return naive_attention_rows(inp.keys[row, :, :n], inp.positions[row, :, :n], inp.queries[row][:, live],
                                inp.query_positions[row][live], inp.scale)


def group_mean(per_query_head: Tensor, h_kv: int) -> Tensor:
    """[H_q, ...] -> [H_kv, ...]: mean over the query heads of each KV head's group."""
    h_q = per_query_head.shape[0]
    return per_query_head.reshape(h_kv, h_q // h_kv, *per_query_head.shape[1:]).mean(dim=1)


def compact(tensor: Tensor, keep: Tensor) -> Tensor:
    """Gather kept slots of one request: tensor [H, n, ...] with keep [H, b] -> [H, b, ...]."""
    index = keep
    while index.dim() < tensor.dim():
        index = index.unsqueeze(-1)
    return torch.gather(tensor, 1, index.expand(*keep.shape, *tensor.shape[2:]))
