"""The methods the suite runs: each engine configuration, and the NVIDIA kvpress press that does the same.

A ``Method`` is one engine configuration: a policy spec and options, sent per request in
``SamplingParams.extra_args`` (``kv_eviction``, ``kv_budget``, ``kv_eviction_config``), so one engine runs
them all on the same samples. ``spec`` None is the full cache (``kv_eviction: "none"``).

Groups:

* ``DEFAULTS``: every base and the meta scores on the bases their papers pair them with (CAOTE and
  FastCAOTE: H2O, TOVA, SnapKV; CriticalKV: SnapKV), each with the project's defaults: what a user gets.
* ``KVPRESS_TWINS``: engine configurations set up as kvpress's presses run (one-shot after the prompt,
  kvpress's scoring options) where our default differs (H2O, KeyDiff, random), for the side-by-side.
* ``ALTERNATIVES``: the readings a paper leaves open (docs/policies.md says which is the default and why).

``PRESSES`` maps a kvpress name to the press factory and to the engine method it is compared with.
Option values that depend on the sample are written as ``QUESTION`` and filled in per request (the
question's token count: NaCl's proxies as its paper defines them).
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any, Callable

QUESTION = "<question tokens>"  # placeholder option value: the question part's token count
TENTH = "<a tenth of the span>"  # placeholder: NaCl's earlier rule, max(32, 10% of the span), half the budget at most
RATIOS = (0.25, 0.5, 0.75, 0.875)
RANDOM_SEEDS = (1, 2, 3)  # further draws of random, each side (seed 0 is the twin's)
SETTINGS = ("aware", "agnostic")


@dataclass(frozen=True)
class Method:
    name: str  # results key
    spec: str | None  # None: the full cache
    options: dict[str, Any] = field(default_factory=dict)
    settings: tuple[str, ...] = SETTINGS  # where it applies
    note: str = ""

    def options_for(self, question_tokens: int, span: int, budget: int) -> dict[str, Any]:
        """The options of one request, placeholders filled in."""
        values = {QUESTION: question_tokens, TENTH: min(max(32, -(-span // 10)), (budget - 4) // 2)}
        return {k: values.get(v, v) if isinstance(v, str) else v for k, v in self.options.items()}


def seeded_name(base: str, seed: int) -> str:
    """A random draw's name: ``base`` for seed 0 (the name kvpress and the engine's twin go by), else
    ``base:seed=N``."""
    return base if seed == 0 else f"{base}:seed={seed}"


def random_twin(seed: int) -> str:
    """The engine's random twin drawn with request seed ``seed``."""
    return seeded_name("random:oneshot", seed)


def layer_random_name(seed: int) -> str:
    """The press name of kvpress's random press drawn per layer from ``seed``."""
    return seeded_name("random:layers", seed)


def random_press_name(seed: int) -> str:
    """The press name of kvpress's own random press (one draw for every layer) seeded ``seed``."""
    return seeded_name("random", seed)


FULL = Method("full", None, note="no eviction (kv_eviction: none)")

DEFAULTS: tuple[Method, ...] = tuple(Method(spec, spec) for spec in (
    "snapkv", "h2o", "tova", "streamingllm", "random", "knorm", "keydiff", "ahakv", "nacl",
    "caote+snapkv", "caote+h2o", "caote+tova", "fastcaote+snapkv", "fastcaote+h2o", "fastcaote+tova",
    "criticalkv+snapkv"))

KVPRESS_TWINS: tuple[Method, ...] = (
    Method("h2o:kvpress", "h2o", {"accumulate": "mean", "recent": 0, "schedule": "oneshot"},
           note="kvpress's ObservedAttentionPress: mean attention per query that saw the token, no recent window"),
    Method("keydiff:oneshot", "keydiff", {"schedule": "oneshot"}, note="kvpress scores once after the prompt"),
    Method("random:oneshot", "random", {"schedule": "oneshot"}, note="kvpress draws once after the prompt"),
    Method("tova:kvpress", "tova", {"recent": 1}, note="kvpress's TOVAPress always keeps the last token"),
    Method("knorm:oneshot", "knorm", {"schedule": "oneshot"},
           note="kvpress scores once after the prompt (chunk by chunk, later chunks' keys see an evicted cache)"),
)

ALTERNATIVES: tuple[Method, ...] = (
    Method("nacl:proxy=question", "nacl", {"proxy": QUESTION}, settings=("aware",),
           note="NaCl's proxies are the question (its paper, section 3): the request says how many tokens"),
    Method("nacl:proxy=10%", "nacl", {"proxy": TENTH}, note="the earlier default: 10% of the prompt"),
    Method("nacl:random=0.7", "nacl", {"random_ratio": 0.7}, note="the paper's ablation optimum (Fig. 5)"),
    Method("nacl:random=0", "nacl", {"random_ratio": 0.0}, note="no random part"),
    # AhaKV's readings, named by what they change from the default (gain "scaled", pooling "avg"); the
    # issue #30 ablation's rows (docs/benchmarks/quality.md#ahakv-at-small-budgets) carry these names.
    Method("ahakv:gain=raw", "ahakv", {"gain": "raw"},
           note="eta = sqrt(2 ln(i/k)) on the scaled logits (the paper's derivation, section 3.3), pooled"),
    Method("ahakv:pooling=none", "ahakv", {"pooling": "none"}, note="F not pooled (the value prior's pooling only)"),
    Method("ahakv:gain=raw:pooling=none", "ahakv", {"gain": "raw", "pooling": "none"},
           note="the derivation's gain, F not pooled: the default before the ablation"),
    Method("ahakv:gain=none:pooling=none", "ahakv", {"gain": "none", "pooling": "none"},
           note="plain softmax, F not pooled (the paper's 'w/o SG-softmax' ablation of that reading)"),
    Method("ahakv:prior=none:gain=raw:pooling=none", "ahakv", {"prior": "none", "gain": "raw", "pooling": "none"},
           note="no value prior (the paper's 'w/o VPE' ablation of the earlier default)"),
    Method("ahakv:recent=16:gain=raw:pooling=none", "ahakv", {"recent": 16, "gain": "raw", "pooling": "none"},
           note="half the observation window, earlier default otherwise"),
    Method("ahakv:recent=64:gain=raw:pooling=none", "ahakv", {"recent": 64, "gain": "raw", "pooling": "none"},
           note="twice the observation window, earlier default otherwise"),
    Method("h2o:recent=0", "h2o", {"recent": 0}, note="heavy hitters only (the CAOTE/KeyDiff harness)"),
    Method("h2o:mean", "h2o", {"accumulate": "mean"}, note="kvpress's normalisation, with the recent window"),
    Method("h2o:chunked", "h2o", {"schedule": "chunked"}, note="evict after every prompt chunk"),
    Method("tova:chunked", "tova", {"schedule": "chunked"}, note="evict after every prompt chunk"),
    Method("streamingllm:oneshot", "streamingllm", {"schedule": "oneshot"},
           note="once after the prompt, as kvpress: by default later chunks attend to an evicted cache"),
    Method("criticalkv+snapkv:max", "criticalkv+snapkv", {"pooling": "max"}, note="the CriticalKV paper's pooling"),
    # Other draws of the engine's random twin (request seeds 1-3): how far two draws of one method are apart
    # on the same samples, the yardstick for the random press's difference from its twin.
    *(Method(random_twin(seed), "random", {"schedule": "oneshot", "seed": seed},
             note=f"the engine's random twin, request seed {seed}") for seed in RANDOM_SEEDS),
)

ALL_METHODS: dict[str, Method] = {m.name: m for m in (FULL, *DEFAULTS, *KVPRESS_TWINS, *ALTERNATIVES)}


@dataclass(frozen=True)
class Press:
    name: str  # results key on the kvpress side
    twin: str  # the engine method it is compared with
    make: Callable[[], Any]  # a fresh press (compression_ratio set by the runner)
    needs_attentions: bool = False  # reads the layer's attention weights (eager attention)


def presses() -> dict[str, Press]:
    """kvpress presses with the engine's settings (imports kvpress: only the kvpress backend calls this)."""
    from kvpress import (CriticalKVPress, KeyDiffPress, KnormPress, ObservedAttentionPress, RandomPress,
                         SnapKVPress, StreamingLLMPress, TOVAPress)

    from benchmarks.quality.layer_random import PerLayerRandomPress

    return {p.name: p for p in (
        Press("snapkv", "snapkv", lambda: SnapKVPress(window_size=32, kernel_size=7)),
        Press("tova", "tova:kvpress", lambda: TOVAPress()),
        Press("observed_attention", "h2o:kvpress", lambda: ObservedAttentionPress(), needs_attentions=True),
        Press("streaming_llm", "streamingllm", lambda: StreamingLLMPress(n_sink=4)),
        Press("keydiff", "keydiff:oneshot", lambda: KeyDiffPress()),
        Press("knorm", "knorm:oneshot", lambda: KnormPress()),
        Press("random", "random:oneshot", lambda: RandomPress(seed=0)),
        Press("criticalkv+snapkv", "criticalkv+snapkv",
              lambda: CriticalKVPress(SnapKVPress(window_size=32, kernel_size=7), epsilon=1e-4, first_stage_ratio=0.5)),
        # More draws of kvpress's random press, and the same press drawing afresh per layer as the engine
        # does (layer_random.py; not kvpress presses): what the random twin's gap comes from.
        *(Press(random_press_name(seed), random_twin(seed), lambda seed=seed: RandomPress(seed=seed))
          for seed in RANDOM_SEEDS),
        *(Press(layer_random_name(seed), random_twin(seed), lambda seed=seed: PerLayerRandomPress(seed=seed))
          for seed in (0, *RANDOM_SEEDS)),
    )}


PRESS_TWINS = {"snapkv": "snapkv", "tova": "tova:kvpress", "observed_attention": "h2o:kvpress",
               "streaming_llm": "streamingllm", "keydiff": "keydiff:oneshot", "knorm": "knorm:oneshot",
               "random": "random:oneshot", "criticalkv+snapkv": "criticalkv+snapkv"}

# Further engine rows compared with a press: a schedule kvpress does not have beside the twin that has it,
# and the random twin beside kvpress's random press drawn per layer from the same seed.
EXTRA_PAIRS = (("streaming_llm", "streamingllm:oneshot"),
               *(("random", random_twin(seed)) for seed in RANDOM_SEEDS),
               ("random:layers", "random:oneshot"))

PROFILES: dict[str, tuple[str, ...]] = {
    # every configuration: the defaults, the kvpress twins and the alternatives
    "everything": tuple(ALL_METHODS),
    # what a user picks from, plus the twins the side-by-side needs
    "defaults": ("full", *(m.name for m in DEFAULTS), *(m.name for m in KVPRESS_TWINS)),
    # a handful, for a quick look
    "quick": ("full", "snapkv", "tova", "h2o", "keydiff", "nacl", "ahakv", "caote+snapkv", "criticalkv+snapkv"),
    # the open readings only
    "alternatives": ("full", "snapkv", "h2o", "tova", "nacl", "ahakv", *(m.name for m in ALTERNATIVES)),
    # AhaKV's readings beside SnapKV (issue #30's small-budget ablation)
    "ahakv": ("full", "snapkv", "ahakv", *(m.name for m in ALTERNATIVES if m.spec == "ahakv")),
}


def kept_tokens(span: int, ratio: float) -> int:
    """Tokens kept per head when a fraction ``ratio`` of ``span`` is removed: kvpress's rule,
    ``int(span * (1 - ratio))`` (its ``compression_ratio`` is the fraction removed)."""
    return int(span * (1 - ratio))
