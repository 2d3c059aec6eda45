"""No operation on the per-step path would make the host wait for the device on CUDA.

The real engine (tiny random Llama, CPU) runs one mixed batch holding every policy spec (every base,
every meta score over every attention-mass base, and the option variants that take other code paths),
each both evicting (in prefill or at the prompt's end, and while decoding) and never evicting, while
``tests/sync_audit.SyncAudit`` watches everything the worker does for eviction: each attention layer's
hook (except vLLM's own attention forward inside it), the per-step builder, the elastic compressions
before the forward, the block-table bookkeeping and the per-row bookkeeping as requests join and leave
the batch (a method's first request allocating that method's buffers aside: once, not per step). The
audit sees every operation these run, whatever function it sits in, so code added on the hook path
later is covered too."""

from __future__ import annotations

import json
from collections import defaultdict
from typing import Any

import pytest
import torch

from tests.engine.helpers import greedy, token_prompt
from tests.policies.helpers import SPECS
from tests.sync_audit import SyncAudit
from vllm_evict.engine import runner as runner_module
from vllm_evict.engine import step_builder
from vllm_evict.engine.runner import HOOK_ATTR

pytestmark = pytest.mark.engine

# Every method is reserved for requests (docs/security.md): its states and weights are allocated at start-up.
SERVER = {"policy": "snapkv", "budget": 64, "window": 8, "request_policies": list(SPECS)}
# Small protected windows, so that budgets below the prompts are possible; extra variants take other paths
# (per-query-head masses, max pooling, the group mean of TOVA).
OPTIONS = {"snapkv": {"window": 8}, "ahakv": {"recent": 8}}
VARIANTS = [("snapkv", {"window": 8, "pooling": "max"}), ("tova", {"heads": "group"}),
            ("caote+snapkv", {"window": 8, "caote_mode": "head"}), ("fastcaote+tova", {"caote_mode": "head"})]
PROMPT, NEW_TOKENS, BUDGET, SLACK = 64, 12, 48, 8  # decode evicts every SLACK tokens


def requests() -> dict[str, tuple[dict, dict]]:
    """name -> (prompt, extra_args): every spec once evicting (budget 48) and once never (budget 1024)."""
    specs = [(spec, OPTIONS.get(spec.split("+")[-1], {})) for spec in SPECS] + VARIANTS
    out = {}
    for i, (spec, options) in enumerate(specs):
        for budget in (BUDGET, 1024):
            extra = {"kv_eviction": spec, "kv_budget": budget,
                     "kv_eviction_config": json.dumps({**options, "slack": SLACK})}
            out[f"{spec}{options or ''}@{budget}"] = (token_prompt(PROMPT + 2 * i, offset=i + 1), extra)
    return out


class AuditedRunner:
    """Runs the worker's eviction entry points inside one ``SyncAudit`` and records, per request, the
    (phase, evicting) kinds of the steps it took part in."""

    def __init__(self, engine: Any) -> None:
        self.runner = runner = engine.runner
        self.audit = SyncAudit()
        self.kinds: dict[str, set[tuple[str, bool]]] = defaultdict(set)
        self.calls: dict[str, int] = defaultdict(int)
        self._restore: list[tuple[Any, str, Any]] = []
        self._inside = False
        for index, (_, module) in enumerate(runner._attention_layers()):
            original = getattr(module.impl.forward, HOOK_ATTR)
            hook = runner._make_hook(index, self._paused(original))
            self._patch(module.impl, "forward", self._audited("hook", hook))
        build = runner.evict_builder.build
        self._patch(runner.evict_builder, "build", self._audited("build", self._recording(build)))
        self._patch(runner, "_apply_compactions", self._audited("compactions", runner._apply_compactions))
        rows = runner.evict_rows  # the per-row bookkeeping vLLM's input batch calls as rows come and go
        for name in ("add", "park", "forget", "clear", "move", "swap"):
            self._patch(rows, name, self._audited("rows", getattr(rows, name)))
        # The first request of a method not seen before allocates that method's buffers: once, not per step.
        self._patch(rows, "on_new_policy", self._paused(rows.on_new_policy))
        self._patch(runner_module, "compress_before_forward",
                    self._audited("compress", runner_module.compress_before_forward))
        self._patch(runner_module, "return_window_pages",
                    self._audited("window_returns", runner_module.return_window_pages))

    def _patch(self, owner: Any, name: str, value: Any) -> None:
        self._restore.append((owner, name, getattr(owner, name)))
        setattr(owner, name, value)

    def restore(self) -> None:
        for owner, name, value in reversed(self._restore):
            setattr(owner, name, value)

    def _audited(self, label: str, fn: Any) -> Any:
        def run(*args: Any, **kwargs: Any) -> Any:
            self.calls[label] += 1
            if self._inside:  # already audited by the enclosing call
                return fn(*args, **kwargs)
            self._inside = True
            try:
                with self.audit:
                    return fn(*args, **kwargs)
            finally:
                self._inside = False
        return run

    def _paused(self, fn: Any) -> Any:
        def run(*args: Any, **kwargs: Any) -> Any:
            with self.audit.paused():
                return fn(*args, **kwargs)
        return run

    def _recording(self, build: Any) -> Any:
        def run(view: Any, plan: Any, num_scheduled: Any) -> Any:
            with self.audit.paused():  # the test's own bookkeeping
                for request_id, computed, prompt in zip(view.req_ids, view.computed, view.prompt):
                    phase = "decode" if computed >= prompt else "prefill"
                    self.kinds[request_id].add((phase, request_id in plan.keep))
                self.audit.mark_host(vllm_host_tensors(self.runner, view))
            return build(view, plan, num_scheduled)
        return run


def vllm_host_tensors(runner: Any, view: Any) -> list[torch.Tensor]:
    """The host-side tensors of vLLM's runner and of this step's batch, which vLLM names ``*_cpu*`` (on a
    GPU they live in host memory; made outside the audit, it would take them for device tensors)."""
    owners = [runner, getattr(view, "batch", None)]
    return [value for owner in owners if owner is not None for name, value in vars(owner).items()
            if "cpu" in name and isinstance(value, torch.Tensor)]


def run_audited(engine: Any, batch: dict[str, tuple[dict, dict]]) -> tuple[AuditedRunner, dict[str, str]]:
    audited = AuditedRunner(engine)
    ids: dict[str, str] = {}
    try:
        names = list(batch)
        outputs = engine.llm.generate([batch[n][0] for n in names],
                                      [greedy(NEW_TOKENS, **batch[n][1]) for n in names], use_tqdm=False)
        ids = {output.request_id: name for name, output in zip(names, outputs)}
        assert all(len(o.outputs[0].token_ids) == NEW_TOKENS for o in outputs)
    finally:
        audited.restore()
    return audited, ids


# Decode windows wait in pages the scheduler lends (the default, with memory to spare), or are accumulated
# query by query (lending off).
@pytest.mark.parametrize("lend", [True, False])
def test_no_step_of_any_policy_synchronises(tiny_llama, engine_factory, monkeypatch, lend):
    if not lend:
        monkeypatch.setenv("VLLM_EVICT_WINDOW_PAGES", "0")
    engine = engine_factory(tiny_llama, SERVER, max_num_seqs=64, max_num_batched_tokens=256, pages=2048)
    batch = requests()
    audited, ids = run_audited(engine, batch)
    violations = sorted({str(v) for v in audited.audit.violations})
    assert not violations, "host-device synchronisations on the per-step path:\n" + "\n".join(violations)
    # The audit saw the work it is meant to see: every spec evicted in a prompt step and in a decode step,
    # and also ran steps that evict nothing (the requests whose budget is above their length never evict).
    # vLLM's internal request ids are the caller's plus "-" and a random suffix.
    kinds = {ids[rid.rsplit("-", 1)[0]]: k for rid, k in audited.kinds.items() if rid.rsplit("-", 1)[0] in ids}
    assert set(kinds) == set(batch)
    for name, seen in kinds.items():
        evicting = name.endswith(f"@{BUDGET}")
        want = {("prefill", True), ("decode", True), ("decode", False)} if evicting else {
            ("prefill", False), ("decode", False)}
        assert want <= seen, f"{name}: steps of kinds {sorted(want - seen)} never ran"
    assert audited.calls["hook"] and audited.calls["build"] and audited.calls["compactions"] and audited.calls["rows"]
    assert audited.audit.ops_seen > 1000, "the audit saw (almost) no tensor operation"
    assert (engine.scheduler.window_pages.loans > 0) == lend


def test_elastic_compressions_do_not_synchronise(tiny_llama, engine_factory):
    """Compressions before the forward (elastic mode, a short pool) go through the same audit."""
    config = {"policy": "snapkv", "budget": 64, "window": 16, "mode": "elastic",
              "request_policies": ["keydiff", "caote+ahakv", "criticalkv+snapkv"]}
    engine = engine_factory(tiny_llama, config, pages=20, max_num_seqs=4)
    batch = {f"r{i}": (token_prompt(150 + 20 * i, offset=i + 1), extra) for i, extra in enumerate(
        [{}, {"kv_eviction": "keydiff"}, {"kv_eviction": "caote+ahakv", "kv_eviction_config": '{"recent": 16}'},
         {"kv_eviction": "criticalkv+snapkv"}])}
    tables = []
    build_group = step_builder.build_group

    def recording(policy, phase, block_table, *args, **kwargs):
        tables.append(block_table.dtype)
        return build_group(policy, phase, block_table, *args, **kwargs)

    step_builder.build_group = recording
    try:
        audited, _ = run_audited(engine, batch)
    finally:
        step_builder.build_group = build_group
    assert audited.calls["compress"] > 0 and engine.runner.evict_builder is not None
    # Compressions and steps hand the kernels block tables of one dtype (vLLM's int32): one compiled variant.
    assert set(tables) == {torch.int32}, set(tables)
    violations = sorted({str(v) for v in audited.audit.violations})
    assert not violations, "host-device synchronisations in elastic compressions:\n" + "\n".join(violations)
