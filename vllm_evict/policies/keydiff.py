"""KeyDiff (Park et al., 2025): keep the keys least similar to the average key direction.

Per KV head, the anchor is the mean of the L2-normalised keys of all n candidates (cache and new block
alike), and a token's score is −cos(k_i, anchor): distinctive keys survive, typical ones are evicted
(keydiff.md §3.2, §4). Only keys are read, so it needs no queries and no attention probabilities.
By default nothing is protected; ``recent`` reproduces the paper's recent-token ablation (§3.6).
"""

from __future__ import annotations

from torch import Tensor

from vllm_evict.policies.base import EvictionInputs, SinksAndRecent, protect

# Floor on key norms before normalising (keydiff.md §3.5): an all-zero key gets k̂ = 0, not NaN.
EPS = 1e-6


def normalised_keys(keys: Tensor) -> Tensor:
    """k̂_i = k_i / max(||k_i||, eps) in fp32: [H_kv, n, d]."""
    k = keys.float()
    return k / k.norm(dim=-1, keepdim=True).clamp_min(EPS)


def keydiff_scores(keys: Tensor) -> Tensor:
    """Anchor form (Eq. 8): −k̂_iᵀμ with μ = mean_i k̂_i, [H_kv, n].

    Dividing by ||μ|| would give the exact −cos(k_i, μ), but it is a positive per-head constant that
    cannot change the ranking, and it is ill-conditioned when ||μ|| ≈ 0 (§3.5), so it is skipped.
    """
    khat = normalised_keys(keys)
    anchor = khat.mean(dim=1, keepdim=True)  # [H_kv, 1, d]
    return -(khat * anchor).sum(dim=-1)


def keydiff_pairwise_scores(keys: Tensor) -> Tensor:
    """Pairwise form (Eq. 7): −Σ_j cos(k_i, k_j), [H_kv, n]. O(n²·d); for checking the anchor form only.

    Σ_j k̂_iᵀk̂_j = n·k̂_iᵀμ, so both forms rank identically (§3.2).
    """
    khat = normalised_keys(keys)
    return -(khat @ khat.transpose(-1, -2)).sum(dim=-1)


class KeyDiff(SinksAndRecent):
    name = "keydiff"
    summary = "keeps the keys least similar (cosine) to the mean key direction; needs no attention"
    paper = ("Park et al., KeyDiff: Key Similarity-Based KV Cache Eviction for Long-Context LLM Inference "
             "in Resource-Constrained Environments (2025)")
    one_shot = False
    is_attention_mass = False

    @property
    def query_window(self) -> int:
        return 0

    def scores(self, inp: EvictionInputs) -> Tensor:
        # The anchor covers every candidate, protected ones included (keydiff.md §9.6).
        return protect(inp.kernels.keydiff_scores(inp), self.protected_mask(inp))
