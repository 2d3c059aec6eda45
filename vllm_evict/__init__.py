"""vllm-evict: per-head KV-cache token eviction for vLLM."""

from vllm_evict.config import EvictionConfig

__version__ = "0.1.0"
__all__ = ["EvictionConfig", "__version__"]
