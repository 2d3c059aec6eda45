"""What eviction needs from vLLM's configuration, and what it refuses at start-up.

``configure_engine_args`` runs on the user's ``EngineArgs`` before vLLM builds its config: it refuses
options eviction cannot work with (each message names the flag to change) and sets what it needs
(its scheduler and worker). CUDA graphs stay as vLLM resolves them, full graphs included, except a mode
that replays every batch as a full graph (engine/cuda_graphs.py). Prefix caching stays as vLLM resolves it:
engine/prefix_sharing.py keeps every page a prefix match can return unwritten. Async scheduling stays as
vLLM resolves it: the eviction scheduler has an async variant (engine/scheduler.py).
The model runner is the one vLLM chooses (Model Runner V2 where vLLM defaults to it, the V1 runner
where it falls back or where ``VLLM_USE_V2_MODEL_RUNNER=0`` asks for it): the worker hooks either.
``check_engine_supported`` and ``check_model_supported`` run on the built ``VllmConfig``, where vLLM may
have derived settings the arguments did not show (a KV connector from ``--kv-offloading-size``, a KV
dtype from the checkpoint, a full CUDA graph mode forced by a fusion).
"""

from __future__ import annotations

import logging
from typing import Any

import torch

logger = logging.getLogger("vllm.vllm_evict")  # under "vllm" so vLLM's log handlers print it

SCHEDULER_CLS = "vllm_evict.engine.scheduler.EvictScheduler"
CPU_WORKER_CLS = "vllm_evict.engine.worker.EvictCPUWorker"
GPU_WORKER_CLS = "vllm_evict.engine.worker.EvictGPUWorker"

# Plain floating-point KV caches: eviction reads, scores and moves K and V as they are stored.
KV_CACHE_DTYPES = ("auto", "float16", "bfloat16", "float32")
# fp8 KV caches with vLLM's per-layer scales (stored = fp8(k / k_scale)): the kernels dequantise what they
# read with the same scales, compaction moves the bytes. The name -> the element type vLLM stores.
FP8_KV_CACHE_DTYPES = {"fp8": torch.float8_e4m3fn, "fp8_e4m3": torch.float8_e4m3fn, "fp8_e5m2": torch.float8_e5m2}
SUPPORTED_KV_CACHE_DTYPES = (*KV_CACHE_DTYPES, *FP8_KV_CACHE_DTYPES)
# The attention op whose Python implementation calls impl.forward, where the eviction hook sits.
ATTENTION_OP = "vllm::unified_attention_with_output"

FULL_GRAPH_HINT = ("eviction runs in Python after each attention layer, and cudagraph_mode FULL replays every "
                   "batch, mixed ones too, as one full CUDA graph without it; leave cudagraph_mode unset (vLLM's "
                   "FULL_AND_PIECEWISE: full graphs on steps without eviction work), set -cc.cudagraph_mode="
                   "FULL_AND_PIECEWISE, FULL_DECODE_ONLY or PIECEWISE, or use --enforce-eager")


def configure_engine_args(engine_args: Any, *, on_cpu: bool | None = None) -> None:
    """Refuse what eviction cannot do, and set what it needs, before vLLM builds its config.

    ``on_cpu`` None asks vLLM's platform; tests pass False to drive the GPU branch on a CPU machine.
    """
    if engine_args.speculative_config:
        raise ValueError("KV eviction does not support speculative decoding; drop --speculative-config "
                         "or --kv-eviction")
    check_kv_cache_dtype(engine_args.kv_cache_dtype)
    if getattr(engine_args, "pipeline_parallel_size", 1) > 1:
        raise ValueError("KV eviction does not support pipeline parallelism yet; use tensor parallelism")
    check_context_parallel(getattr(engine_args, "decode_context_parallel_size", 1),
                           getattr(engine_args, "prefill_context_parallel_size", 1))
    check_kv_transfer(getattr(engine_args, "kv_transfer_config", None),
                      getattr(engine_args, "kv_offloading_size", None))
    check_micro_batching(getattr(engine_args, "enable_dbo", False), getattr(engine_args, "ubatch_size", 0))
    engine_args.scheduler_cls = SCHEDULER_CLS  # with async scheduling, its async variant (plugin.py)
    if on_cpu is None:
        from vllm.platforms import current_platform

        on_cpu = current_platform.is_cpu()
    engine_args.worker_cls = evicting_worker_cls(engine_args.worker_cls, on_cpu)
    if not on_cpu and not engine_args.enforce_eager:
        configure_cuda_graphs(engine_args)


def evicting_worker_cls(worker_cls: str, on_cpu: bool) -> str:
    """The worker qualname to run: ours for ``auto``; the user's class wrapped so that the runner
    mixin is still installed; unchanged when it is one of ours already."""
    from vllm_evict.engine.worker import is_evicting_worker, wrapped_worker_qualname

    if worker_cls == "auto":
        return CPU_WORKER_CLS if on_cpu else GPU_WORKER_CLS
    if is_evicting_worker(worker_cls):
        return worker_cls
    logger.info("vllm_evict: --worker-cls %s is wrapped so that the eviction runner is installed", worker_cls)
    return wrapped_worker_qualname(worker_cls)


# ---- single checks, shared by the argument and the config stage ---------------------------------------
def check_kv_cache_dtype(dtype: Any) -> None:
    if str(dtype) not in SUPPORTED_KV_CACHE_DTYPES:
        raise ValueError(f"KV eviction does not support the KV cache dtype {dtype} (its scales are not per layer); "
                         f"use --kv-cache-dtype auto or fp8 (supported: {', '.join(SUPPORTED_KV_CACHE_DTYPES)})")


def fp8_storage_dtype(kv_cache_dtype: Any) -> torch.dtype | None:
    """The float8 element type of an fp8 KV cache (None: a plain floating-point cache)."""
    return FP8_KV_CACHE_DTYPES.get(str(kv_cache_dtype))


def check_context_parallel(decode: int, prefill: int) -> None:
    if (decode or 1) > 1 or (prefill or 1) > 1:
        raise ValueError(f"KV eviction does not support context parallelism (decode_context_parallel_size="
                         f"{decode}, prefill_context_parallel_size={prefill}): it interleaves a request's "
                         "tokens over ranks by position, which eviction reorders; drop "
                         "--decode-context-parallel-size / --prefill-context-parallel-size")


def check_kv_transfer(kv_transfer_config: Any, kv_offloading_size: Any = None) -> None:
    if kv_offloading_size is not None:
        raise ValueError(f"KV eviction does not support KV cache offloading (kv_offloading_size="
                         f"{kv_offloading_size}): the offloaded pages would be saved after eviction compacted "
                         "them; drop --kv-offloading-size")
    if kv_transfer_config is not None:
        connector = getattr(kv_transfer_config, "kv_connector", None)
        if connector is None and isinstance(kv_transfer_config, dict):
            connector = kv_transfer_config.get("kv_connector")
        raise ValueError(f"KV eviction does not support KV connectors (kv_connector={connector}): a "
                         "connector saves and loads pages under their logical token hashes, which eviction "
                         "rewrites; drop --kv-transfer-config")


def check_micro_batching(enable_dbo: bool, ubatch_size: int) -> None:
    if enable_dbo or (ubatch_size or 0) > 1:
        raise ValueError(f"KV eviction does not support micro-batching (enable_dbo={bool(enable_dbo)}, "
                         f"ubatch_size={ubatch_size}): each micro-batch runs attention on part of the step's "
                         "requests; drop --enable-dbo / --ubatch-size")


# ---- CUDA graphs (GPU) --------------------------------------------------------------------------------
def configure_cuda_graphs(engine_args: Any) -> None:
    """Full CUDA graphs only where a mode leaves batches to PIECEWISE or eager too (engine/cuda_graphs.py
    keeps the steps with eviction work out of full graphs); attention between the graph pieces.

    The mode stays as the user or vLLM sets it (unset: vLLM's FULL_AND_PIECEWISE), except FULL, whose
    mixed batches have no other graph; attention+quant fusion (it drops attention from the splitting ops
    and switches to FULL) and splitting ops without attention are refused, an unset fusion flag is
    turned off.
    """
    from vllm.config.compilation import CompilationConfig

    compilation = engine_args.compilation_config
    if compilation is None or isinstance(compilation, dict):
        compilation = CompilationConfig(**(compilation or {}))
        engine_args.compilation_config = compilation
    check_full_graph_mode(compilation.cudagraph_mode, resolved=False)
    if compilation.pass_config.fuse_attn_quant:
        raise ValueError("KV eviction does not support attention+quant fusion (pass_config.fuse_attn_quant="
                         "True): vLLM then captures attention inside full CUDA graphs on every step, which "
                         "replay it without eviction; drop fuse_attn_quant from -cc.pass_config")
    compilation.pass_config.fuse_attn_quant = False  # unset: an optimization level may turn it on
    check_splitting_ops(compilation)


def check_full_graph_mode(mode: Any, *, resolved: bool) -> None:
    """Refuse a CUDA graph mode whose mixed batches run full graphs (FULL): a step with eviction work
    must have a graph without attention inside, or none."""
    from vllm.config.compilation import CUDAGraphMode

    if mode is not None and mode.mixed_mode() == CUDAGraphMode.FULL:
        where = "vLLM resolved " if resolved else ""
        raise ValueError(f"KV eviction does not support full CUDA graphs for every batch, but {where}"
                         f"cudagraph_mode={mode.name}" + (" (an option or the model forces it)" if resolved else "")
                         + ": " + FULL_GRAPH_HINT)


def check_splitting_ops(compilation: Any) -> None:
    """With piecewise graphs, attention must be one of the ops the graph is split at."""
    mode, ops = compilation.cudagraph_mode, compilation.splitting_ops
    # Unset: vLLM's default, FULL_AND_PIECEWISE, has piecewise graphs.
    if (mode is None or mode.has_piecewise_cudagraphs()) and ops and ATTENTION_OP not in ops:
        raise ValueError(f"KV eviction needs attention outside the captured CUDA graphs, but splitting_ops "
                         f"{list(ops)} leave {ATTENTION_OP} inside them; add it to -cc.splitting_ops, or "
                         "use --enforce-eager")


def check_cuda_graphs(compilation: Any) -> None:
    """The resolved compilation config: no full graphs for mixed batches, attention between the pieces."""
    check_full_graph_mode(compilation.cudagraph_mode, resolved=True)
    check_splitting_ops(compilation)


# ---- the built config ---------------------------------------------------------------------------------
def check_engine_supported(vllm_config: Any) -> None:
    """Settings vLLM derived while building its config (not visible in the arguments)."""
    check_kv_cache_dtype(vllm_config.cache_config.cache_dtype)
    parallel = vllm_config.parallel_config
    check_context_parallel(getattr(parallel, "decode_context_parallel_size", 1),
                           getattr(parallel, "prefill_context_parallel_size", 1))
    check_kv_transfer(vllm_config.kv_transfer_config)
    check_micro_batching(getattr(parallel, "enable_dbo", False), getattr(parallel, "ubatch_size", 0))
    check_cuda_graphs(vllm_config.compilation_config)


def check_model_supported(vllm_config: Any) -> None:
    model_config = vllm_config.model_config
    name = model_config.model
    if getattr(model_config, "use_mla", False):
        raise ValueError(f"KV eviction does not support MLA attention ({name}): its latent cache has no "
                         "per-head keys; serve it without --kv-eviction")
    sliding = model_config.get_sliding_window() if hasattr(model_config, "get_sliding_window") else None
    hf_config = model_config.hf_text_config
    if sliding or getattr(hf_config, "layer_types", None) and any(
            t != "full_attention" for t in hf_config.layer_types):
        raise ValueError(f"KV eviction does not support sliding-window attention ({name}): the window is "
                         "counted in cache slots, which eviction reorders; serve it without --kv-eviction")
    if uses_alibi(hf_config, model_config.architectures):
        raise ValueError(f"KV eviction does not support ALiBi attention ({name}): its bias depends on the "
                         "slot index; serve it without --kv-eviction")
    if model_config.uses_mrope:
        raise ValueError(f"KV eviction does not support M-RoPE models ({name}) yet")
    check_data_parallel_supported(vllm_config)


def o_proj_unavailable(vllm_config: Any) -> str | None:
    """Why CriticalKV cannot use this model's output projection, or None when it can.

    CriticalKV projects values through each layer's ``o_proj`` weight. A quantized checkpoint stores it
    in the quantization's own layout and scales (fp8 transposed with per-tensor or block scales, packed
    integers, ...), which cannot be read as a matrix without that method's dequantisation; reading the raw
    tensor would select the wrong tokens silently, so such models refuse CriticalKV instead."""
    quantization = getattr(getattr(vllm_config, "model_config", None), "quantization", None)
    if quantization:
        return (f"criticalkv reads each layer's output projection weights in full precision, but this model's "
                f"weights are quantized ({quantization}); choose a method without criticalkv, e.g. snapkv")
    return None


def check_policy_supported(vllm_config: Any, config: Any) -> None:
    """The server's ``ServerConfig`` (its method and the ``request_policies`` it reserves for requests),
    an ``EvictionConfig`` or None: ValueError with the reason when this model cannot run one of them.
    Requests can only choose methods the server reserved, so this start-up check covers them too."""
    from vllm_evict.config import ServerConfig, build_policy, parse_spec

    if config is None:
        return
    if isinstance(config, ServerConfig):
        needs = [config.eviction.build_policy().needs_o_proj]
        needs += [build_policy(*parse_spec(spec), {}).needs_o_proj for spec in config.request_policies]
    else:
        needs = [config.build_policy().needs_o_proj]
    reason = o_proj_unavailable(vllm_config) if any(needs) else None
    if reason:
        raise ValueError(reason)


def check_data_parallel_supported(vllm_config: Any) -> None:
    """Data parallelism runs one engine core per rank, each with its own EvictScheduler, workers and plan;
    for dense models vLLM runs those cores independently, which eviction needs. MoE ranks are kept in
    step instead: an idle rank runs dummy forward passes in lockstep with busy ones (the runner never
    evicts in them, but that path is untested), so it stays refused."""
    model_config = vllm_config.model_config
    if vllm_config.parallel_config.data_parallel_size > 1 and model_config.is_moe:
        raise ValueError(f"KV eviction does not support data parallelism with MoE models ({model_config.model}) "
                         "yet: idle data-parallel MoE engines run dummy steps in lockstep with busy ones; use "
                         "--data-parallel-size 1 (tensor parallelism works) or serve it without --kv-eviction")


ALIBI_ARCHITECTURES = {"BloomForCausalLM", "JAISLMHeadModel"}  # always ALiBi


def uses_alibi(hf_config: Any, architectures: list[str] | None) -> bool:
    attn_config = getattr(hf_config, "attn_config", None)
    flag_in_attn = attn_config.get("alibi") if isinstance(attn_config, dict) else getattr(attn_config, "alibi", False)
    return bool(getattr(hf_config, "alibi", False) or flag_in_attn
                or getattr(hf_config, "position_embedding_type", "") == "alibi"
                or ALIBI_ARCHITECTURES.intersection(architectures or ()))
