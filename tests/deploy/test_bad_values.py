"""Bad values are refused by `helm template` / `helm install` with a message that says what is wrong.

Two layers: values.schema.json (helm validates the merged values against it before rendering, in
`helm template`, `helm install`, `helm upgrade` and `helm lint`) and `fail` checks in the templates for
rules that span several values. Each case asserts the exact message. About 1 s.
"""

from __future__ import annotations

import re
from typing import Any

import pytest

helm = pytest.importorskip("helm_python", reason="needs helm-python-sdk (make install)")

from tests.deploy.chart import CHART, chart, merge_values, profile, render_manifests  # noqa: E402

POLICY_ENUM = "at '/eviction/policy': value must be one of 'none', 'snapkv', 'h2o',"

# values -> the line helm's schema validation prints for them.
SCHEMA_CASES: list[tuple[str, dict[str, Any], str]] = [
    ("unknown policy", {"eviction": {"policy": "snapvk"}}, POLICY_ENUM),
    ("meta score without a base", {"eviction": {"policy": "caote"}}, POLICY_ENUM),
    ("meta score over a base it cannot wrap", {"eviction": {"policy": "caote+knorm"}}, POLICY_ENUM),
    ("budget 0", {"eviction": {"budget": 0}}, "at '/eviction/budget': minimum: got 0, want 1"),
    ("negative budget", {"eviction": {"budget": -5}}, "at '/eviction/budget': minimum: got -5, want 1"),
    ("budget not above the tokens snapkv always keeps", {"eviction": {"policy": "snapkv", "budget": 32}},
     "at '/eviction/budget': minimum: got 32, want 33"),
    ("budget not above caote+snapkv's window (the default policy)", {"eviction": {"budget": 16}},
     "at '/eviction/budget': minimum: got 16, want 33"),
    ("budget not above streamingllm's sinks", {"eviction": {"policy": "streamingllm", "budget": 4,
                                                              "config": {"schedule": "chunked"}}},
     "at '/eviction/budget': minimum: got 4, want 5"),
    ("budget as text", {"eviction": {"budget": "2k"}}, "at '/eviction/budget': got string, want integer"),
    # null deletes the default budget (helm's rule for null values), so the budget is missing.
    ("no budget with a policy", {"eviction": {"policy": "keydiff", "budget": None}},
     "at '/eviction': missing property 'budget'"),
    ("config as a JSON string", {"eviction": {"config": '{"window": 16}'}},
     "at '/eviction/config': got string, want object"),
    ("config option of the wrong type", {"eviction": {"config": {"window": "16"}}},
     "at '/eviction/config/window': got string, want integer"),
    ("unknown config option", {"eviction": {"config": {"windw": 16}}},
     "at '/eviction/config': additional properties 'windw' not allowed"),
    ("budget inside config", {"eviction": {"config": {"budget": 64}}},
     "at '/eviction/config': additional properties 'budget' not allowed"),
    ("unknown schedule", {"eviction": {"config": {"schedule": "lazy"}}},
     "at '/eviction/config/schedule': value must be one of 'chunked', 'oneshot'"),
    ("slack 0", {"eviction": {"config": {"slack": 0}}}, "at '/eviction/config/slack': minimum: got 0, want 1"),
    ("misspelt eviction key", {"eviction": {"polcy": "snapkv"}},
     "at '/eviction': additional properties 'polcy' not allowed"),
    ("tensor parallel 0", {"vllmConfig": {"tensorParallelSize": 0}},
     "at '/vllmConfig/tensorParallelSize': minimum: got 0, want 1"),
    ("unknown model source", {"model": {"source": "s3"}},
     "at '/model/source': value must be one of 'pvc', 'initContainer'"),
    ("relative model path", {"model": {"path": "models/x"}},
     "at '/model/path': 'models/x' does not match pattern '^/'"),
    ("extraArgs as one string", {"vllmConfig": {"extraArgs": "--max-num-seqs 8"}},
     "at '/vllmConfig/extraArgs': got string, want array"),
    ("unknown top-level key", {"evictoin": {"policy": "snapkv"}}, "at '': additional properties 'evictoin' not allowed"),
    ("ray workers 0", {"ray": {"enabled": True, "workers": 0}}, "at '/ray/workers': minimum: got 0, want 1"),
    ("unknown Ray auth mode", {"ray": {"auth": {"mode": "none"}}},
     "at '/ray/auth/mode': value must be one of 'token', 'disabled'"),
    ("Ray token under an empty key", {"ray": {"auth": {"secretKey": ""}}},
     "at '/ray/auth/secretKey': minLength: got 0, want 1"),
    ("unknown compile cache source", {"compileCache": {"source": "hostPath"}},
     "at '/compileCache/source': value must be one of 'emptyDir', 'pvc'"),
    ("relative plugin path", {"plugin": {"path": "site"}}, "at '/plugin/path': 'site' does not match pattern '^/.'"),
    ("pip arguments as one string", {"plugin": {"pipArgs": "--index-url x"}}, "at '/plugin/pipArgs': got string, want array"),
]

# values -> the message of the template's `fail`.
TEMPLATE_CASES: list[tuple[str, list[Any], str]] = [
    ("model outside its volume", [{"model": {"path": "/data/model"}}],
     'model.path "/data/model" is not under model.mountPath "/models", where the model volume is mounted: '
     "put the model below it"),
    ("eviction flag in extraArgs", [{"vllmConfig": {"extraArgs": ["--kv-budget=64"]}}],
     "vllmConfig.extraArgs must not contain --kv-budget: the chart sets it from its values (eviction.*, "
     "vllmConfig.*, model.*, containerPort, ray.enabled); set it there"),
    ("port in extraArgs", [{"vllmConfig": {"extraArgs": ["--port", "9000"]}}],
     "vllmConfig.extraArgs must not contain --port: the chart sets it from its values (eviction.*, "
     "vllmConfig.*, model.*, containerPort, ray.enabled); set it there"),
    ("more ranks than GPUs", [profile("gpu"), {"vllmConfig": {"tensorParallelSize": 2}}],
     "vllmConfig.tensorParallelSize 2 needs 2 GPUs in the pod, but resources ask for 1 nvidia.com/gpu: "
     "raise it, or set ray.enabled to span pods"),
    ("Ray with two heads", [profile("gpu"), profile("ray-gpu"), {"replicaCount": 2}],
     "ray.enabled needs replicaCount 1 (one Ray head runs the server), got 2"),
    ("Ray without tensor parallelism", [profile("gpu"), profile("ray-gpu"), {"vllmConfig": {"tensorParallelSize": 1}}],
     "ray.enabled spreads tensor-parallel ranks over pods: set vllmConfig.tensorParallelSize to 2 or more "
     "(or turn ray.enabled off)"),
    ("Ray with too few GPUs", [profile("gpu"), profile("ray-gpu"), {"vllmConfig": {"tensorParallelSize": 4}}],
     "vllmConfig.tensorParallelSize 4 needs 4 GPUs, but the Ray cluster has 2 (head 1 + 1 workers x 1): "
     "raise ray.workers or the nvidia.com/gpu resources"),
    ("Ray on a single-node claim", [profile("gpu"), {"ray": {"enabled": True}, "vllmConfig": {"tensorParallelSize": 2}}],
     "ray.enabled: every Ray pod loads the model from model.path, so the model claim must be shared: set "
     "model.pvc.accessModes to [ReadOnlyMany] or [ReadWriteMany], use model.pvc.existingClaimName, or use "
     "model.source initContainer without persistent"),
    ("plugin install without the package", [{"plugin": {"install": True}}],
     "plugin.install needs the package: set plugin.wheelConfigMap (a ConfigMap holding the wheel) or plugin.package "
     "(a wheel URL or a requirement your index serves)"),
    ("one cache claim for two pods", [{"replicaCount": 2, "compileCache": {"source": "pvc"}}],
     "compileCache.source pvc: several pods (replicas or Ray workers) mount the cache claim: set "
     "compileCache.pvc.accessModes to [ReadWriteMany], use compileCache.pvc.existingClaimName, or use source emptyDir"),
]


@pytest.mark.parametrize("values, message", [c[1:] for c in SCHEMA_CASES], ids=[c[0] for c in SCHEMA_CASES])
def test_schema_refuses(values: dict[str, Any], message: str) -> None:
    # `helm template` / `helm install`: the merged values are checked before anything renders.
    with pytest.raises(helm.HelmValuesError) as err:
        render_manifests(values)
    assert str(err.value).startswith("values don't meet the specifications of the schema(s)"), str(err.value)
    assert f"- {message}" in str(err.value), str(err.value)
    # The same check alone, and in `helm lint`, which reports it as an error.
    with pytest.raises(helm.HelmValuesError, match=re.escape(f"- {message}")):
        chart().validate_schema(merge_values(values))
    report = helm.lint(str(CHART), merge_values(values), strict=True)
    assert any(message in e for e in report["errors"]), report


@pytest.mark.parametrize("sources, message", [c[1:] for c in TEMPLATE_CASES], ids=[c[0] for c in TEMPLATE_CASES])
def test_templates_refuse(sources: list[Any], message: str) -> None:
    with pytest.raises(helm.HelmRenderError) as err:
        render_manifests(*sources)
    assert str(err.value).endswith(message), str(err.value)


def test_every_good_setting_renders() -> None:
    """The refusals above are specific: the nearest good values render (guards against a schema that
    refuses everything)."""
    for values in ({"eviction": {"policy": "keydiff", "budget": 1}}, {"eviction": {"policy": "none", "budget": None}},
                   {"eviction": {"config": {"window": 16, "schedule": "oneshot", "slack": 1, "seed": 3}}},
                   {"eviction": {"policy": "criticalkv+nacl", "config": {"alpha": 0.25, "proxy": 64}}},
                   {"eviction": {"policy": "snapkv", "budget": 33}},
                   # A smaller window: the budget is the server's to check (at start-up).
                   {"eviction": {"policy": "snapkv", "budget": 16, "config": {"window": 8}}},
                   {"model": {"path": "/models/a/b", "source": "initContainer"}},
                   {"vllmConfig": {"extraArgs": ["--kv-cache-dtype", "auto", "--max-num-seqs=8"]}},
                   {"plugin": {"install": True, "package": "vllm-evict==0.1.0"}},
                   {"replicaCount": 2, "compileCache": {"source": "pvc", "pvc": {"accessModes": ["ReadWriteMany"]}}}):
        assert render_manifests(values)
