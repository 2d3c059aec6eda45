"""What the scheduler tells the workers each step. Crosses a pickle boundary under the multiprocess
executor, so it holds only plain data."""

from __future__ import annotations

from dataclasses import dataclass, field

from vllm_evict.config import EvictionConfig
from vllm_evict.policies.base import Phase

# Name of the attribute the scheduler sets on vLLM's SchedulerOutput.
PLAN_ATTR = "kv_eviction_plan"


@dataclass(frozen=True)
class RequestStep:
    tokens_before: int  # logical tokens computed before this step
    phys_before: int  # tokens physically cached before this step
    num_new: int  # tokens this step appends
    phase: Phase
    keep: int | None  # tokens to keep after this step's attention, or None for no eviction
    config: EvictionConfig

    @property
    def phys_after(self) -> int:
        return self.phys_before + self.num_new


@dataclass
class EvictionPlan:
    steps: dict[str, RequestStep] = field(default_factory=dict)  # every scheduled request with eviction on
