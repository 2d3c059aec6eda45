"""Render the Helm chart offline (Helm v4 SDK, no helm binary, no cluster) and check what it renders.

``render(*sources)`` merges values files and dicts the way ``helm -f a.yaml -f b.yaml --set ...`` does
and returns the rendered Kubernetes objects. ``validate(obj)`` checks one object against the Kubernetes
OpenAPI schemas (kubernetes-validate, strict: unknown fields fail) and the ServiceMonitor, a CRD, against
tests/deploy/schemas/.
"""

from __future__ import annotations

import copy
import importlib.resources
import json
from functools import lru_cache
from pathlib import Path
from typing import Any, Iterable, Mapping, Union

import helm_python as helm
import jsonschema
import kubernetes_validate
import yaml
from referencing import Registry, Resource

REPO = Path(__file__).resolve().parents[2]
CHART = REPO / "deploy" / "helm" / "vllm-evict"
VALUES = Path(__file__).resolve().parent / "values"
SCHEMAS = Path(__file__).resolve().parent / "schemas"
RELEASE = "demo"
NAMESPACE = "llm"
# The oldest Kubernetes the chart is checked against (its 1.29 schemas accept every field rendered) and the
# newest schemas kubernetes-validate ships.
KUBE_VERSIONS = ("1.29.0", kubernetes_validate.utils.latest_version())
# Kinds whose schema is not Kubernetes' own: kind -> schema file under SCHEMAS.
CRD_SCHEMAS = {("monitoring.coreos.com/v1", "ServiceMonitor"): "servicemonitor-monitoring-v1.json"}

Source = Union[str, Path, Mapping[str, Any]]


def profile(name: str) -> Path:
    """A values file shipped with the chart: values-cpu.yaml, values-gpu.yaml, values-ray-gpu.yaml."""
    return CHART / f"values-{name}.yaml"


def values_file(name: str) -> Path:
    """A values file of these tests (tests/deploy/values/NAME.yaml)."""
    return VALUES / f"{name}.yaml"


def _merge(into: dict[str, Any], update: Mapping[str, Any]) -> None:
    for key, value in update.items():
        if isinstance(value, Mapping) and isinstance(into.get(key), dict):
            _merge(into[key], value)
        else:
            into[key] = copy.deepcopy(value)  # lists and scalars replace; None is kept (helm then drops the key)


def merge_values(*sources: Source) -> dict[str, Any]:
    """User values from files and dicts, later ones winning, as with repeated ``helm -f``."""
    merged: dict[str, Any] = {}
    for source in sources:
        data = source if isinstance(source, Mapping) else yaml.safe_load(Path(source).read_text()) or {}
        _merge(merged, data)
    return merged


@lru_cache(maxsize=1)
def chart() -> helm.Chart:
    return helm.Chart.load(CHART)


def render_manifests(*sources: Source) -> dict[str, str]:
    """Template path -> rendered text, as ``helm template`` prints it (raises helm's error on bad values)."""
    return chart().render(merge_values(*sources), name=RELEASE, namespace=NAMESPACE)


def render(*sources: Source) -> list[dict[str, Any]]:
    """The Kubernetes objects the chart renders for these values (NOTES.txt left out)."""
    objects = []
    for path, text in sorted(render_manifests(*sources).items()):
        if path.endswith(".yaml"):
            objects += [obj for obj in yaml.safe_load_all(text) if obj]
    return objects


def find(objects: Iterable[Mapping[str, Any]], kind: str, name: str | None = None) -> dict[str, Any]:
    """The one object of ``kind`` (named ``name`` when given)."""
    hits = [o for o in objects if o["kind"] == kind and (name is None or o["metadata"]["name"] == name)]
    assert len(hits) == 1, f"expected one {kind} {name or ''}, rendered {[(o['kind'], o['metadata']['name']) for o in objects]}"
    return dict(hits[0])


def container(workload: Mapping[str, Any], name: str | None = None) -> dict[str, Any]:
    containers = workload["spec"]["template"]["spec"]["containers"]
    if name is None:
        assert len(containers) == 1, [c["name"] for c in containers]
        return containers[0]
    return next(c for c in containers if c["name"] == name)


def env_of(container_spec: Mapping[str, Any]) -> dict[str, Any]:
    """name -> value (or valueFrom) of a container's environment."""
    return {e["name"]: e.get("value", e.get("valueFrom")) for e in container_spec.get("env") or []}


@lru_cache(maxsize=None)
def _crd_validator(schema_file: str, kube_version: str) -> jsonschema.protocols.Validator:
    definitions_ref = importlib.resources.files("kubernetes_validate").joinpath(
        f"kubernetes-json-schema/v{kubernetes_validate.utils.major_minor(kube_version)}.0-local-strict/_definitions.json")
    definitions = Resource.from_contents(json.loads(definitions_ref.read_text()))
    schema = json.loads((SCHEMAS / schema_file).read_text())
    registry = Resource.from_contents(schema) @ (definitions @ Registry())
    return jsonschema.Draft202012Validator(schema, registry=registry)


def validate(obj: Mapping[str, Any], kube_version: str) -> None:
    """Raise AssertionError naming the object, the field and the reason when ``obj`` is not valid."""
    label = f"{obj.get('kind')}/{obj.get('metadata', {}).get('name')} (Kubernetes {kube_version})"
    crd = CRD_SCHEMAS.get((obj.get("apiVersion"), obj.get("kind")))
    try:
        if crd is not None:
            _crd_validator(crd, kube_version).validate(obj)
        else:
            kubernetes_validate.validate(dict(obj), kube_version, strict=True)
    except jsonschema.ValidationError as err:
        path = ".".join(str(p) for p in err.absolute_path)
        raise AssertionError(f"{label} is not valid at {path or '(top)'}: {err.message}") from None
    except kubernetes_validate.utils.SchemaNotFoundError as err:
        raise AssertionError(f"{label}: no offline schema ({err.message}); add one to {SCHEMAS}") from None
