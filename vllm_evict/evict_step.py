"""The eviction step of one layer over a paged KV cache: the one implementation the engine's model
runner, the HF reference runner and ``benchmarks/kernels.py`` all run.

A step has two phases, both batched over the step's requests:

* **record** (every step, every layer): the step's new tokens get their logical position and their
  per-token policy state written next to their K/V slots (addressed like vLLM addresses K/V: page and
  offset of each token's slot). Requests in elastic mode, which can be compressed at any step, also
  put their queries in a per-row ring buffer of recent queries. A fixed number of tensor operations
  per layer, whatever the batch size; nothing allocated per request, no host-device synchronisation.
* **groups** (only the rows the plan names): per group of rows that share a policy and a phase,
  - the step's queries that belong to a row's observation window (``Group.window_tokens``) add their
    softmax rows over the row's cache to the per-token window mass (state ``WINDOW_MASS``): the window
    is accumulated as its queries arrive, so no query is kept for fixed-mode requests (see
    ``vllm_evict.schedule.window_end`` for which queries those are). A request inside a decode window
    that the scheduler has lent pages of the KV pool (engine/window_pages.py) writes its window's
    queries there instead (``Record.window_writes``), and the same mass is computed once, from them, in
    the step that reads the window (``Group.window_read``);
  - one policy call scores the rows (padded to the longest) and the survivors of every (row, KV head)
    are compacted in place into the row's first slots, K, V, positions and state alike; a row that has
    read its window starts the next one from zero.

This module knows nothing of vLLM: callers describe their cache with ``LayerCache`` and their step
with a ``StepPlan`` (built once per step, shared by every layer).
"""

from __future__ import annotations

from dataclasses import dataclass, field
from functools import partial
from typing import Callable

import numpy as np
import torch
from torch import Tensor

from vllm_evict import dense, ops
from vllm_evict.engine.window_pages import NO_PAGE, SlotRows, window_entries
from vllm_evict.engine.window_pages import slot_addresses as window_slot_addresses
from vllm_evict.kv_shard import KVShard
from vllm_evict.paged import as_bytes, dequantize, gather_tokens, slot_addresses
from vllm_evict.paged_ops import DISPATCHED, DispatchedScoreOps, PagedScoreOps
from vllm_evict.policies.base import WINDOW_MASS, WINDOW_STATES, Deferred, EvictionInputs, Phase, Policy
from vllm_evict.staging import to_device as pinned_to_device

POSITION_DTYPE = torch.int32  # logical positions below 2^31 (max_model_len is far below)
_ZEROS: dict[tuple[torch.device, torch.dtype], Tensor] = {}


def device_zero(buffer: Tensor) -> Tensor:
    """A 0-dim zero of ``buffer``'s dtype on its device, made once. Written through tensor indices, a
    Python 0.0 would become a CPU tensor that ``index_put_`` copies to the device (a blocking copy)."""
    key = (buffer.device, buffer.dtype)
    zero = _ZEROS.get(key)
    if zero is None:
        zero = _ZEROS[key] = torch.zeros((), dtype=buffer.dtype, device=buffer.device)
    return zero


@dataclass
class LayerCache:
    """One layer's paged tensors. Slot s of a request lives in page ``block_table[s // bs]`` at offset
    ``s % bs``; every tensor below is indexed [page, head, offset, ...]."""

    index: int  # layer index (seeds the random policies)
    k: Tensor  # [num_pages, H_kv, bs, d] view of the K cache (any strides)
    v: Tensor  # [num_pages, H_kv, bs, d] view of the V cache
    positions: Tensor  # int32 [num_pages, H_kv, bs]: logical position of every slot
    state: dict[str, Tensor]  # fp32 [num_pages, H_kv, bs] per state name
    ring: Tensor | None  # [slots, W, H_q, d] recent queries of each request (its ring slot)
    scale: float  # the attention's softmax scale
    o_proj: Tensor | None = None  # [hidden, H_q * d] this rank's output projection, when a policy needs it
    head_offset: int = 0  # global index of this rank's first KV head
    # Tensor parallel (scale-out): this rank's KV heads; with replicated KV heads the group sums are
    # completed across the copies (vllm_evict/kv_shard.py). None: this rank holds whole groups.
    shard: KVShard | None = None
    # The window slots of lent pages as rows [rows, d] of the KV storage (engine/window_pages.py
    # ``slot_row_view``); None: reached through ``k`` and ``v``.
    slot_rows: Tensor | None = None
    # An fp8 KV cache (``k``/``v`` are float8 views): vLLM's per-layer scales, fp32 [] or [1] on the device
    # (stored = fp8(k / k_scale)); the scores read k * k_scale as the attention does. None: not quantized.
    k_scale: Tensor | None = None
    v_scale: Tensor | None = None

    @property
    def quantized(self) -> bool:
        return self.k_scale is not None

    @property
    def kv_heads_total(self) -> int:
        """KV heads of the whole layer over every tensor-parallel rank (0: this rank holds them all)."""
        return self.shard.total_kv_heads if self.shard is not None else 0

    @property
    def kv_replicas(self) -> int:
        return self.shard.kv_replicas if self.shard is not None else 1

    @property
    def record_ops(self) -> DispatchedScoreOps:
        """The ops ``init_state`` computes with (CriticalKV's nu is a sum over the group)."""
        return DispatchedScoreOps(self.shard) if self.shard is not None else DISPATCHED

    @property
    def ring_flat(self) -> Tensor | None:
        """The ring as [slots * W, H_q, d] (entry slot * W + position % W), computed once per ring."""
        ring = self.ring
        if ring is None:
            return None
        cached = self.__dict__.get("_ring_flat")
        if cached is None or cached[0] is not ring:
            cached = self.__dict__["_ring_flat"] = (ring, ring.view(-1, *ring.shape[2:]))
        return cached[1]


@dataclass
class Record:
    """The step's new tokens, in the order of the attention's packed token axis."""

    pages: Tensor  # int64 [T]: page of each token's slot
    offsets: Tensor  # int64 [T]: offset inside the page
    positions: Tensor  # int32 [T]: logical position
    ring_index: Tensor | None  # int64 [T'] flat ring entry (slot * W + position % W) of each token written
    ring_tokens: Tensor | None = None  # int64 [T']: the tokens written to the ring (None: all T of them)
    window_writes: "WindowWrites | None" = None  # window queries that go to lent pages


@dataclass
class WindowWrites:
    """Window queries written into lent pages (engine/window_pages.py), in the one form the layers use:
    ``rows`` where the layers have slot rows (``LayerCache.slot_rows``), int64 [3, m] (row, token in the
    step, query head), one per slot and KV head (window_pages.write_rows); else ``k`` and ``v``, for the
    slots in K halves and in V halves, int64 [4, n] (token in the step, member of the KV head's query
    group, page, offset)."""

    k: Tensor | None = None
    v: Tensor | None = None
    rows: Tensor | None = None
    query_heads: int = 0  # H_q (with ``rows``): the query heads of a token

    def sources(self, per_token: int) -> Tensor:
        """Each row's query as a row of ``query_rows`` (token * per_token + query head): one op."""
        assert self.rows is not None
        return self.rows[2].add(self.rows[1], alpha=per_token)


@dataclass
class WindowRead:
    """A group's windows as they wait in lent pages, with the queries' logical positions [R, M] (-1:
    padding), in the one form the layers use: ``rows``, the slots as rows of ``LayerCache.slot_rows``,
    [R, M * H_kv * G] in the order (entry, KV head, member); else the slots of each row's queries
    [R, M * G] (``pages``, ``offsets``, and whether in the V half, ``in_v``)."""

    positions: Tensor
    rows: Tensor | None = None
    pages: Tensor | None = None
    offsets: Tensor | None = None
    in_v: Tensor | None = None


@dataclass
class Group:
    """Rows of this step that share a policy and a phase and must be looked at (evicting, or a policy
    that updates its state every step). Device tensors are [R] unless noted."""

    policy: Policy
    phase: Phase
    block_table: Tensor  # [R, pages] the rows' pages after this step's tokens, logical order
    lengths: Tensor  # int64: physical tokens after this step's tokens
    width: int  # N = max(lengths), on the host
    seq_len: Tensor  # int64: logical tokens after this step
    num_new: Tensor  # int64
    seed: Tensor  # int64
    ring_rows: Tensor | None  # int64: each row's ring slot (elastic rows: their window is kept as queries)
    step_tokens: Tensor | None  # int64 [R, M]: the row's tokens of this step (read by update_state)
    step_token_positions: Tensor | None  # int64 [R, M]: their positions, -1 on padding
    slot_pages: Tensor  # int64 [R, N]: page of each row's slots 0..N-1, the null page past its length
    slot_offsets: Tensor  # int64 [R, N]
    budget: Tensor | None = None  # int64: tokens kept per head (None: nothing evicted)
    budget_max: int = 0
    max_seq_len: int = 0  # host: the largest seq_len
    labels: list = field(default_factory=list)  # caller's ids of the rows (request ids), for records
    # The accumulated observation window (fixed mode; None: the rows' windows are queries in the ring):
    window_count: Tensor | None = None  # int64: the window's queries so far, this step's included
    window_tokens: Tensor | None = None  # int64 [R, M']: this step's queries that join the window
    window_positions: Tensor | None = None  # int64 [R, M']: their positions, -1 on padding
    window_gain: Tensor | None = None  # fp32: the window's logit gain (None: 1)
    window_reset: bool = False  # the rows read their window in this step: the next one starts from zero
    # The rows' window queries waiting in lent pages, read in this step (None: none waits there).
    window_read: WindowRead | None = None
    # The numeric options that differ between the rows (``EvictionInputs.row_options``), their host bounds,
    # and each row's query window when they differ (elastic rows read that many from the ring).
    row_options: dict[str, Tensor] = field(default_factory=dict)
    row_option_bounds: dict[str, tuple] = field(default_factory=dict)
    query_window: Tensor | None = None


@dataclass
class StepPlan:
    record: Record
    groups: list[Group]
    ring_positions: Tensor | None  # int64 [slots, W]: position of each ring entry, -1 when empty
    zero_states: tuple[str, ...] = ()  # states that start at 0 (written for all layers by record_step)
    # Prefix caching (engine/prefix_sharing.py): int64 [n] original pages and [n] their copies, copied in
    # every layer after its attention and before anything else is written (None: no copy this step).
    copies: tuple[Tensor, Tensor] | None = None


# ---- building a step (host side, once per step) ---------------------------------------------------
def ring_entries(token_rows: np.ndarray, slots: np.ndarray, in_row: np.ndarray, counts: np.ndarray,
                 computed: np.ndarray, window: int,
                 recording: np.ndarray | None = None) -> tuple[np.ndarray, np.ndarray | None]:
    """(flat ring entries, tokens): the last W tokens of each row go to slot * W + position % W (earlier
    ones would be overwritten in the same write, so they are not written at all); ``tokens`` lists the
    tokens written, or is None when that is every token (a decode step where every row records).

    token_rows, in_row [T]: each token's row and index within the row's tokens of this step;
    slots, counts, computed [rows]: each row's ring slot, tokens this step and logical tokens before it;
    recording [rows]: the rows whose queries go to the ring (None: all; elastic rows, see ``StepBuilder._windows``)."""
    position = computed[token_rows] + in_row
    recent = in_row >= counts[token_rows] - window
    if recording is not None:
        recent &= recording[token_rows]
    entries = slots[token_rows] * window + position % window
    if recent.all():
        return entries, None
    tokens = np.nonzero(recent)[0]
    return entries[tokens], tokens


def step_token_index(starts: np.ndarray, counts: np.ndarray, computed: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    """Each row's tokens of this step in the packed token axis [R, M] (``starts``: first token of each
    row there), and their logical positions (-1 on padding)."""
    width = int(counts.max()) if counts.size else 0
    column = np.arange(width)
    present = column[None, :] < counts[:, None]
    index = np.where(present, starts[:, None] + column[None, :], 0)
    positions = np.where(present, computed[:, None] + column[None, :], dense.EMPTY_QUERY)
    return index, positions


@dataclass(frozen=True)
class WindowStep:
    """A group's accumulated observation window in this step, on the host (fixed mode): per row, the
    step's last ``recorded`` queries join the window, which then holds ``count`` queries; ``gain`` the
    logit gain of its softmax rows (None: 1); ``reset``: the rows read the window in this step;
    ``lent``: the rows' lent pages [R, P] when their window's queries wait there (None: each adds its
    mass as it arrives), then ``queued`` of them wait there after this step's, the latest ones, in
    ``capacity`` entries, ``group`` query heads per KV head here (engine/window_pages.py)."""

    recorded: np.ndarray
    count: np.ndarray
    gain: np.ndarray | None = None
    reset: bool = False
    lent: np.ndarray | None = None
    queued: np.ndarray | None = None
    capacity: np.ndarray | None = None
    group: int = 1
    flush: bool = False  # the lent pages are given back: their queries' mass is read now, the window goes on


def build_group(policy: Policy, phase: Phase, block_table: Tensor, page_size: int, *, lengths: np.ndarray,
                computed: np.ndarray, scheduled: np.ndarray, seed: np.ndarray, keep: np.ndarray | None,
                ring_rows: np.ndarray | None, token_starts: np.ndarray | None,
                window: WindowStep | None = None, row_options: dict[str, np.ndarray] | None = None,
                to_device: Callable[..., list[Tensor]] | None = None, slot_rows: SlotRows | None = None) -> Group:
    """A ``Group`` from host arrays over its rows (one host-to-device copy for all of them).

    block_table [R, pages] on the device; lengths: physical tokens after this step; computed: logical
    tokens before it; scheduled: this step's tokens; keep: tokens kept per head, or None (no eviction);
    ring_rows: each row's ring row (None: the rows keep no queries); token_starts: each row's first
    token in the packed token axis (needed to read this step's queries); window: the rows' accumulated
    observation window (None: none, or kept as queries in the ring); row_options: the numeric options
    that differ between the rows, per row (int64, or float64 for a float option; ``query_window``: each
    row's policy's query window), the others are the policy's own; to_device: the engine's staging
    (``vllm_evict.staging.Staging.to_device``; None: pinned blocks of PyTorch's host allocator); slot_rows:
    where the layers' window slots are rows of their KV storage (None: they are not)."""
    device = block_table.device
    if to_device is None:
        to_device = partial(pinned_to_device, device=device)
    width = int(lengths.max())
    rows = len(lengths)
    # One [7, R'] block, R' even: every row of it starts 16 bytes aligned, whatever R is, so the kernels
    # reading these per-row numbers see the same pointer alignment on every step (no Triton recompile).
    host = np.zeros((7, rows + rows % 2), dtype=np.int64)
    for i, column in enumerate((lengths, computed + scheduled, scheduled, seed, keep, ring_rows,
                                window.count if window is not None else None)):
        if column is not None:
            host[i, :rows] = column
    arrays = {"host": host}
    # This step's queries, for the policies that read them every step (H2O; AhaKV's decode, whose window
    # is otherwise in the ring with them).
    reads_step = policy.query_window is None or (policy.needs_every_step and ring_rows is None)
    if reads_step and token_starts is not None:
        arrays["step"] = np.stack(step_token_index(token_starts, scheduled, computed))
    lent = window.lent if window is not None else None
    deferred = lent[:, 0] != NO_PAGE if lent is not None else np.zeros(rows, dtype=bool)
    if window is not None and token_starts is not None:
        recorded = np.where(deferred, 0, window.recorded)  # a deferred row's queries went to its pages
        if recorded.any():
            skipped = scheduled - recorded  # the window takes each row's last ``recorded`` tokens
            arrays["window"] = np.stack(step_token_index(token_starts + skipped, recorded, computed + skipped))
    if window is not None and (window.reset or window.flush) and lent is not None and (window.queued > 0).any():
        entries, positions = window_entries(computed + scheduled, window.queued, window.capacity)
        slots = window_slot_addresses(lent, entries, window.group, page_size)
        arrays["read_positions"] = positions
        if slot_rows is not None:  # [R, M, G, H_kv] -> (entry, KV head, member)
            arrays["read_rows"] = slot_rows.rows(slots).transpose(0, 1, 3, 2).reshape(rows, -1)
        else:
            arrays["read"] = np.stack([slots.page.reshape(rows, -1), slots.offset.reshape(rows, -1),
                                       slots.in_v.reshape(rows, -1)])
    options = row_options or {}
    names = sorted(options)
    if names:  # floats travel as the bits of their float64
        arrays["options"] = np.stack([options[n].astype(np.float64).view(np.int64) if options[n].dtype.kind == "f"
                                      else options[n].astype(np.int64) for n in names])
    reads_mass = "window" in arrays or "read_positions" in arrays
    if reads_mass and window.gain is not None:  # the staging copies int64: the float32 gains travel as their bits
        arrays["gain"] = window.gain.astype(np.float32).view(np.int32).astype(np.int64)
    copied = dict(zip(arrays, to_device(*arrays.values())))  # one host-to-device copy for all of them
    lengths_t, seq_len, num_new, seed_t, budget, ring_t, count_t = copied["host"][:, :rows].unbind(0)
    step_tokens, step_positions = copied["step"].unbind(0) if "step" in copied else (None, None)
    window_tokens, window_positions = copied["window"].unbind(0) if "window" in copied else (None, None)
    window_gain = copied["gain"].to(torch.int32).view(torch.float32) if "gain" in copied else None
    window_read = None
    if "read_rows" in copied:
        window_read = WindowRead(positions=copied["read_positions"], rows=copied["read_rows"])
    elif "read" in copied:
        read_pages, read_offsets, read_in_v = copied["read"].unbind(0)
        window_read = WindowRead(positions=copied["read_positions"], pages=read_pages, offsets=read_offsets,
                                 in_v=read_in_v.bool())
    per_row = {n: copied["options"][i].view(torch.float64) if options[n].dtype.kind == "f" else copied["options"][i]
               for i, n in enumerate(names)}
    query_window = per_row.pop("query_window", None)
    bounds = {n: (options[n].min().item(), options[n].max().item()) for n in per_row}
    pages, offsets = slot_addresses(block_table, width, page_size, lengths_t)  # padding: the null page
    return Group(policy=policy, phase=phase, block_table=block_table, lengths=lengths_t, width=width,
                 seq_len=seq_len, num_new=num_new, seed=seed_t,
                 ring_rows=ring_t if ring_rows is not None else None, step_tokens=step_tokens,
                 step_token_positions=step_positions, slot_pages=pages, slot_offsets=offsets,
                 budget=budget if keep is not None else None,
                 budget_max=int(keep.max()) if keep is not None else 0,
                 max_seq_len=int((computed + scheduled).max()),
                 window_count=count_t if window is not None else None, window_tokens=window_tokens,
                 window_positions=window_positions, window_gain=window_gain,
                 window_reset=window is not None and window.reset, window_read=window_read,
                 row_options=per_row, row_option_bounds=bounds, query_window=query_window)


# ---- record phase ---------------------------------------------------------------------------------
def record_step(positions: Tensor, states: dict[str, Tensor], plan: StepPlan) -> None:
    """Once per step for every layer at once: the new tokens' positions ([L, num_pages, H, bs] buffer)
    and the states that start at 0, and the ring's positions."""
    rec = plan.record
    positions[:, rec.pages, :, rec.offsets] = rec.positions.view(-1, 1, 1)  # indexed: [T, L, H]
    for name in plan.zero_states:
        states[name][:, rec.pages, :, rec.offsets] = device_zero(states[name])
    if plan.ring_positions is not None and rec.ring_index is not None:
        written = rec.positions if rec.ring_tokens is None else rec.positions.index_select(0, rec.ring_tokens)
        plan.ring_positions.view(-1).index_copy_(0, rec.ring_index, written.long())


def copy_pages(cache: LayerCache, copies: tuple[Tensor, Tensor]) -> None:
    """Copy whole pages of one layer (K, V, positions and every state) from ``copies[0]`` to
    ``copies[1]``: a request leaving a shared or hashed page keeps what it held, the page stays as it was."""
    src, dst = copies
    for buffer in (as_bytes(cache.k), as_bytes(cache.v), cache.positions, *cache.state.values()):
        buffer[dst] = buffer[src]


def quantize_dequantize(x: Tensor, scale: Tensor | None, dtype: torch.dtype) -> Tensor:
    """``x`` as the attention will read it back from an fp8 cache of element type ``dtype`` with ``scale``
    (x itself when the cache is not quantized)."""
    if scale is None:
        return x
    return ((x.float() / scale).to(dtype).float() * scale).to(x.dtype)


def tokens_view(x: Tensor, num_tokens: int, heads: int, head_size: int) -> Tensor:
    """[T', heads * head_size] or [T', heads, head_size] -> [num_tokens, heads, head_size] (T' >= num_tokens:
    a CUDA graph pads the token axis); a view, no copy."""
    view = x.view(-1, heads, head_size)
    return view if view.shape[0] == num_tokens else view[:num_tokens]


def record_layer(cache: LayerCache, plan: StepPlan, initializers: list[Policy], query: Tensor, key: Tensor,
                 value: Tensor) -> None:
    """This layer's part of the record phase: the step's queries into the ring and into lent window pages,
    and the per-token state computed from K/V by ``initializers`` (one policy per computed state).
    query/key/value are the attention's own inputs (``tokens_view`` shapes them); the common case costs
    one tensor operation."""
    rec = plan.record
    num_tokens = rec.pages.shape[0]
    if rec.window_writes is not None:
        write_window_queries(cache, rec.window_writes, query, num_tokens)
    ring = cache.ring_flat
    if ring is not None and rec.ring_index is not None:
        q = tokens_view(query, num_tokens, ring.shape[1], ring.shape[2])
        if rec.ring_tokens is not None:  # a prefill chunk: only each request's last W tokens
            q = q.index_select(0, rec.ring_tokens)
        ring.index_copy_(0, rec.ring_index, q if q.dtype == ring.dtype else q.to(ring.dtype))
    if not initializers:
        return
    heads, head_size = cache.k.shape[1], cache.k.shape[3]
    k = tokens_view(key, num_tokens, heads, head_size).transpose(0, 1)
    v = tokens_view(value, num_tokens, heads, head_size).transpose(0, 1)
    if cache.quantized:  # states from K/V as the cache holds them (the step's tokens only)
        k = quantize_dequantize(k, cache.k_scale, cache.k.dtype)
        v = quantize_dequantize(v, cache.v_scale, cache.v.dtype)
    for policy in initializers:
        for name, values in policy.init_state(k, v, cache.o_proj, cache.record_ops).items():
            cache.state[name][rec.pages, :, rec.offsets] = values.transpose(0, 1).float()


def _query_groups(cache: LayerCache, query: Tensor, num_tokens: int) -> Tensor:
    """The step's queries as [T, H_kv, G, d] (query head h * G + g belongs to KV head h)."""
    heads, head_size = cache.k.shape[1], cache.k.shape[3]
    view = query.view(query.shape[0], -1, head_size)
    return view[:num_tokens].view(num_tokens, heads, -1, head_size)


def query_rows(query: Tensor, num_tokens: int, heads: int, head_size: int) -> tuple[Tensor, int]:
    """The step's query vectors as rows [n, head_size] and the rows per token (query head j of token t
    is row t * per_token + j): a view of the query's storage when its heads are rows (a slice of the
    fused QKV projection is), else a copy."""
    q = tokens_view(query, num_tokens, heads, head_size)
    if q.stride(2) == 1 and q.stride(1) == head_size and q.stride(0) % head_size == 0:
        per_token = q.stride(0) // head_size
        return q.as_strided(((num_tokens - 1) * per_token + heads, head_size), (head_size, 1)), per_token
    return q.reshape(-1, head_size), heads


def write_window_queries(cache: LayerCache, writes: WindowWrites, query: Tensor, num_tokens: int) -> None:
    """Window queries into lent pages: each (query, group member) into its slot of a K or V half, as rows
    of the KV storage (one gather, one scatter), or through the same views the engine compacts K and V
    with (engine/window_pages.py)."""
    if not num_tokens:
        return
    if writes.rows is not None:  # the builder makes rows only when every layer has slot rows
        assert cache.slot_rows is not None
        rows, per_token = query_rows(query, num_tokens, writes.query_heads, cache.k.shape[3])
        values = rows.index_select(0, writes.sources(per_token))
        cache.slot_rows.index_copy_(0, writes.rows[0], values if values.dtype == cache.slot_rows.dtype
                                    else values.to(cache.slot_rows.dtype))
        return
    q = _query_groups(cache, query, num_tokens)
    for target, slots in ((cache.k, writes.k), (cache.v, writes.v)):
        assert slots is not None
        token, member, page, offset = slots.unbind(0)
        values = q[token, :, member]  # [n, H_kv, d]
        target[page, :, offset] = values if values.dtype == target.dtype else values.to(target.dtype)


def page_window(cache: LayerCache, read: WindowRead) -> tuple[Tensor, Tensor]:
    """The window queries waiting in lent pages, [R, H_q, M, d] (laid out as ``step_window``'s: a view of
    [R, M, H_q, d], so the kernels see one stride pattern), and their positions [R, M]."""
    if read.rows is not None:  # the builder makes rows only when every layer has slot rows
        assert cache.slot_rows is not None
        rows, entries = read.positions.shape
        grouped = cache.slot_rows.index_select(0, read.rows.view(-1)).view(rows, entries, -1, cache.k.shape[3])
        return grouped.permute(0, 2, 1, 3), read.positions
    assert read.pages is not None and read.offsets is not None and read.in_v is not None
    k = cache.k[read.pages, :, read.offsets]  # [R, M * G, H_kv, d]
    v = cache.v[read.pages, :, read.offsets]
    slots = torch.where(read.in_v[:, :, None, None], v, k)
    rows, _, heads, head_size = slots.shape
    entries = read.positions.shape[1]
    grouped = slots.view(rows, entries, -1, heads, head_size).transpose(2, 3)  # [R, M, H_kv, G, d]
    return grouped.reshape(rows, entries, -1, head_size).permute(0, 2, 1, 3), read.positions


# ---- evict phase ----------------------------------------------------------------------------------
def group_inputs(cache: LayerCache, group: Group, plan: StepPlan, step_query: Tensor) -> EvictionInputs:
    """The policy's view of ``group``'s rows in this layer (K and V deferred)."""
    policy = group.policy
    table, width = group.block_table, group.width  # whole pages: padding reads what its page holds
    positions = gather_tokens(cache.positions, table, width)
    state = {name: gather_tokens(cache.state[name], table, width)
             for name in (*policy.state_names, *policy.head_state_names)}
    window = policy.query_window
    rows, h_q, d = group.lengths.shape[0], step_query.shape[1], step_query.shape[2]
    if group.step_tokens is not None:  # this step's queries, each counted once
        queries = step_query[group.step_tokens].permute(0, 2, 1, 3)  # [R, H_q, M, d]
        query_positions = group.step_token_positions
    elif group.ring_rows is not None and window and cache.ring is not None:  # elastic rows keep their queries
        queries = cache.ring[group.ring_rows].permute(0, 2, 1, 3)  # [R, H_q, W, d]
        count = group.query_window if group.query_window is not None else window
        query_positions = dense.latest_queries(plan.ring_positions[group.ring_rows], group.seq_len, count)
    else:
        queries = step_query.new_zeros(rows, h_q, 0, d)
        query_positions = torch.zeros(rows, 0, dtype=torch.int64, device=step_query.device)
    return EvictionInputs(
        keys=Deferred(partial(dequantized_tokens, cache.k, table, width, cache.k_scale)),
        values=Deferred(partial(dequantized_tokens, cache.v, table, width, cache.v_scale)),
        positions=positions, lengths=group.lengths, queries=queries, query_positions=query_positions,
        scale=cache.scale, seq_len=group.seq_len, num_new=group.num_new, phase=group.phase, state=state,
        layer=cache.index, seed=group.seed, head_offset=cache.head_offset, o_proj=cache.o_proj,
        budget=group.budget, budget_max=group.budget_max, max_seq_len=group.max_seq_len,
        kv_replicas=cache.kv_replicas, kv_heads_total=cache.kv_heads_total, window_count=group.window_count,
        row_options=group.row_options, row_option_bounds=group.row_option_bounds,
        ops=PagedScoreOps(k_cache=cache.k, v_cache=cache.v, positions=cache.positions,
                          block_table=group.block_table, lengths=group.lengths, width=group.width,
                          shard=cache.shard, k_scale=cache.k_scale, v_scale=cache.v_scale))


def dequantized_tokens(cache: Tensor, block_table: Tensor, width: int, scale: Tensor | None) -> Tensor:
    """``gather_tokens`` of a K or V view, dequantised (fp32) when the cache is fp8: only the rows' slots."""
    return dequantize(gather_tokens(cache, block_table, width), scale)


def window_states(policy: Policy) -> tuple[str, ...]:
    """The accumulated-window states ``policy`` keeps (they are zeroed, not compacted, after a window is read)."""
    return (*(n for n in policy.state_names if n in WINDOW_STATES), *policy.head_state_names)


def step_window(group: Group, step_query: Tensor) -> tuple[Tensor, Tensor]:
    """This step's queries that join the rows' windows ([R, H_q, M', d]) and their positions [R, M']."""
    return step_query[group.window_tokens].permute(0, 2, 1, 3), group.window_positions


def window_queries(cache: LayerCache, group: Group, step_query: Tensor) -> tuple[Tensor, Tensor] | None:
    """The queries that add to the rows' window mass in this step, and their positions: this step's
    window queries (accumulated as they arrive) and the ones that waited in lent pages until this read,
    in one pass (None: none)."""
    parts = []
    if group.window_tokens is not None:
        parts.append(step_window(group, step_query))
    if group.window_read is not None:
        parts.append(page_window(cache, group.window_read))
    if len(parts) < 2:
        return parts[0] if parts else None
    # Joined along the entries of [R, M, H_q, d], then viewed as [R, H_q, M, d]: the layout of each part.
    joined = torch.cat([p[0].permute(0, 2, 1, 3) for p in parts], dim=1)
    return joined.permute(0, 2, 1, 3), torch.cat([p[1] for p in parts], dim=1)


def fuses_window(cache: LayerCache, group: Group) -> bool:
    """Whether the rows' window mass goes straight into the paged state (``ops.accumulate_window_mass``):
    a group-summed mass on a rank that holds whole query-head groups. Otherwise (a per-query-head mass, or
    KV heads replicated over tensor-parallel ranks, whose partial sums are completed first) it is
    computed, completed and added by ``accumulate_window``."""
    return not group.policy.head_state_names and cache.kv_replicas == 1


def add_window_mass(cache: LayerCache, group: Group, queries: Tensor, query_positions: Tensor) -> None:
    """The window mass of ``queries`` ([R, H_q, M, d] at ``query_positions`` [R, M]) added into the paged
    state WINDOW_MASS at the rows' slots: the window pass, its softmax and the update in one operation."""
    gain = None
    if group.window_gain is not None:
        gain = dense.row_gains(group.window_gain, query_positions.shape[0], query_positions.shape[1],
                               query_positions.device).contiguous()
    ops.accumulate_window_mass(cache.state[WINDOW_MASS], cache.k, group.block_table, group.lengths,
                               query_operand(cache, queries.permute(0, 2, 1, 3)), query_positions, cache.scale,
                               positions=cache.positions, width=group.width, gain=gain, k_scale=cache.k_scale)


def query_operand(cache: LayerCache, queries: Tensor) -> Tensor:
    """Queries as the window kernels take them: in the cache's dtype, or as they are over an fp8 cache
    (the kernels dequantise the keys to the queries' dtype)."""
    return queries if cache.quantized or queries.dtype == cache.k.dtype else queries.to(cache.k.dtype)


def accumulate_window(cache: LayerCache, group: Group, inp: EvictionInputs, queries: Tensor,
                      query_positions: Tensor) -> EvictionInputs:
    """Add the softmax rows of window queries ([R, H_q, M, d] at ``query_positions`` [R, M], -1: none;
    ``step_window`` or ``page_window``) over each row's cache to its window-mass states, in the cache
    and in ``inp``; returns the updated inputs."""
    window_inp = inp.evolve(queries=queries, query_positions=query_positions)
    heads = bool(group.policy.head_state_names)
    mass = inp.ops.window_mass(window_inp, gain=group.window_gain, per_query_head=heads)
    updates = {}
    if heads:  # [R, H, G, N]: kept per query head, and summed over the group
        updates[group.policy.head_state_names[0]] = inp.state[group.policy.head_state_names[0]] + mass.permute(0, 1, 3, 2)
        mass = mass.sum(dim=2)
    updates[WINDOW_MASS] = inp.state[WINDOW_MASS] + mass
    for name, value in updates.items():
        cache.state[name][group.slot_pages, :, group.slot_offsets] = value.transpose(1, 2)
    return inp.with_state({**inp.state, **updates})


def evict_layer(cache: LayerCache, plan: StepPlan, step_query: Tensor) -> list[Tensor | None]:
    """The evict phase of one layer: every group scored, its state written back, its survivors
    compacted. Returns each group's kept slots [R, H, budget_max] (None where it evicts nothing)."""
    kept: list[Tensor | None] = []
    for group in plan.groups:
        window = window_queries(cache, group, step_query)
        if window is not None and fuses_window(cache, group):
            add_window_mass(cache, group, *window)  # into the paged state, before anything reads it
            window = None
            if group.budget is None and not group.window_reset and not group.policy.needs_every_step:
                kept.append(None)  # a step inside a window, nothing else to do
                continue
        inp = group_inputs(cache, group, plan, step_query)
        if window is not None:
            inp = accumulate_window(cache, group, inp, *window)
        result = group.policy.step(inp)
        pages, offsets = group.slot_pages, group.slot_offsets
        windows = window_states(group.policy)
        for name in group.policy.state_names:
            if name not in windows and result.state[name] is not inp.state[name]:
                cache.state[name][pages, :, offsets] = result.state[name].transpose(1, 2)
        if result.keep is not None:
            moved = (n for n in group.policy.state_names if n not in windows)
            buffers = [cache.k, cache.v, cache.positions, *(cache.state[n] for n in moved)]
            ops.compact_tokens(buffers, group.block_table, result.keep, group.budget)
        if group.window_reset:  # the window was read: the survivors start the next one from zero
            for name in windows:
                cache.state[name][pages, :, offsets] = device_zero(cache.state[name])
        kept.append(result.keep)
    return kept


def state_initializers(policies: list[Policy]) -> tuple[list[Policy], tuple[str, ...]]:
    """(policies whose ``init_state`` computes something, states that start at 0) for a step whose
    groups use ``policies``: each computed state is computed once, by the first policy declaring it."""
    computed: dict[str, Policy] = {}
    zero: dict[str, None] = {}
    for policy in policies:
        for name in policy.computed_state:
            computed.setdefault(name, policy)
        for name in (*policy.state_names, *policy.head_state_names):
            if name not in policy.computed_state:
                zero[name] = None
    initializers = list(dict.fromkeys(computed.values()))
    return initializers, tuple(n for n in zero if n not in computed)
