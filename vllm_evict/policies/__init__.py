"""The eviction-policy library: one module per method, pure PyTorch, device-agnostic."""

from __future__ import annotations

import importlib

from vllm_evict.policies.base import EvictionInputs, Phase, Policy, StepResult

# name -> "module:Class"; imported lazily so that listing policies stays cheap.
BASE_POLICIES: dict[str, str] = {
    "snapkv": "snapkv:SnapKV",
    "h2o": "h2o:H2O",
    "tova": "tova:TOVA",
    "streamingllm": "streamingllm:StreamingLLM",
    "random": "random_policy:RandomPolicy",
    "knorm": "knorm:KeyNorm",
    "keydiff": "keydiff:KeyDiff",
    "ahakv": "ahakv:AhaKV",
    "nacl": "nacl:NaCl",
}
META_POLICIES: dict[str, str] = {
    "caote": "caote:CAOTE",
    "fastcaote": "caote:FastCAOTE",
    "criticalkv": "criticalkv:CriticalKV",
}


def load_class(name: str) -> type[Policy]:
    target = BASE_POLICIES.get(name) or META_POLICIES.get(name)
    if target is None:
        raise KeyError(name)
    module, cls = target.split(":")
    return getattr(importlib.import_module(f"vllm_evict.policies.{module}"), cls)


__all__ = [
    "BASE_POLICIES", "META_POLICIES", "EvictionInputs", "Phase", "Policy", "StepResult", "load_class",
]
