"""Kubernetes: kustomize overlays rendered by kubectl and validated against the API schemas, the
Helm chart's values against values.schema.json, and Helm's lint and template run through Helm's own
library (helm-python-sdk, a dev dependency: no helm binary needed).

The same semantic checks run on every rendering: probes on the health endpoints, ports that agree
with SPARSECAST_PORT, references to ConfigMaps/Secrets/keys that exist, GPU resources for GPU
rollout and for nothing else.
"""

from __future__ import annotations

import copy
import functools
import json
import re
import shutil
import subprocess

import helm_python
import jsonschema
import kubernetes_validate
import pytest
import yaml

from tests.paths import REPO_ROOT

ROOT = REPO_ROOT
KUSTOMIZE = ROOT / "k8s" / "kustomize"
CHART = ROOT / "k8s" / "helm" / "sparsecast"
K8S_VERSION = "1.32.0"  # a version every current managed Kubernetes offers
SERVICES = {"registry": 8100, "trainer": 8000, "rollout": 8200}
# Least privilege (issue 27): each service's credentials, variable → the Secret's key. Only the
# trainer and the registry hold the publish token, only the trainer and the workers the worker
# token, and each service's own API token is its alone.
API, PUBLISH, WORKER, REDIS = (
    "SPARSECAST_API_TOKEN", "SPARSECAST_PUBLISH_TOKEN", "SPARSECAST_WORKER_TOKEN", "SPARSECAST_REDIS_URL")
CREDENTIALS = {
    "trainer": {API: API, PUBLISH: PUBLISH, WORKER: WORKER, REDIS: REDIS},
    "registry": {API: "REGISTRY_API_TOKEN", PUBLISH: PUBLISH, REDIS: REDIS},
    "rollout": {API: "ROLLOUT_API_TOKEN", WORKER: WORKER, REDIS: REDIS},
}
STORE_KEYS = {"SPARSECAST_STORE_OPTIONS__ACCESS_KEY_ID", "SPARSECAST_STORE_OPTIONS__SECRET_ACCESS_KEY"}


def secret_env(container: dict) -> dict[str, str]:
    """variable → Secret key, for the container's env entries taken from a Secret."""
    return {e["name"]: e["valueFrom"]["secretKeyRef"]["key"] for e in container.get("env", [])
            if "secretKeyRef" in e.get("valueFrom", {})}


def kubectl_kustomize(overlay: str) -> list[dict]:
    if shutil.which("kubectl") is None:
        pytest.skip("kubectl is not installed")
    return [doc for doc in yaml.safe_load_all(_render_overlay(overlay)) if doc]


@functools.cache
def _render_overlay(overlay: str) -> str:
    rendered = subprocess.run(
        ["kubectl", "kustomize", str(KUSTOMIZE / "overlays" / overlay)],
        capture_output=True, text=True, timeout=60,
    )
    assert rendered.returncode == 0, rendered.stderr
    return rendered.stdout


def chart_values(*files: str, overrides: dict | None = None) -> dict:
    """What `-f FILE ... --set ...` would pass: the user-supplied values only (Helm merges the
    chart's defaults itself)."""
    values: dict = {}
    for name in files:
        deep_merge(values, yaml.safe_load((CHART / name).read_text()))
    deep_merge(values, copy.deepcopy(overrides or {}))
    return values


def helm_lint(values: dict) -> list[str]:
    """`helm lint --strict`: every finding (warnings count, info does not) as text."""
    report = helm_python.lint(CHART, values, strict=True, namespace="sparsecast",
                              kube_version=f"v{K8S_VERSION}")
    return report["errors"] + [f"{m['path']}: {m['error']}" for m in report["messages"] if m["severity"] >= 2]


def helm_template(*files: str, overrides: dict | None = None, hooks: bool = False) -> list[dict]:
    """`helm template demo CHART -n sparsecast -f FILE...` through Helm's own library
    (helm-python-sdk); `hooks`: keep hook objects such as the `helm test` pod."""
    with helm_python.Chart.load(CHART) as chart:
        rendered = chart.render(chart_values(*files, overrides=overrides), name="demo",
                                namespace="sparsecast", is_install=True)
    docs = [doc for path, text in sorted(rendered.items()) if path.endswith(".yaml")
            for doc in yaml.safe_load_all(text) if doc]
    return docs if hooks else [d for d in docs if "helm.sh/hook" not in d["metadata"].get("annotations", {})]


def helm_notes(*files: str, overrides: dict | None = None) -> str:
    with helm_python.Chart.load(CHART) as chart:
        rendered = chart.render(chart_values(*files, overrides=overrides), name="demo",
                                namespace="sparsecast", is_install=True)
    return rendered["sparsecast/templates/NOTES.txt"]


def load_values(*overrides: str) -> dict:
    values = yaml.safe_load((CHART / "values.yaml").read_text())
    for name in overrides:
        deep_merge(values, yaml.safe_load((CHART / name).read_text()))
    return values


def deep_merge(base: dict, override: dict) -> None:
    for key, value in override.items():
        if isinstance(value, dict) and isinstance(base.get(key), dict):
            deep_merge(base[key], value)
        else:
            base[key] = value


def values_errors(values: dict) -> list[str]:
    schema = json.loads((CHART / "values.schema.json").read_text())
    return [error.message for error in jsonschema.Draft7Validator(schema).iter_errors(values)]


def container_env(container: dict) -> dict[str, str | None]:
    return {entry["name"]: entry.get("value") for entry in container.get("env", [])}


def sparsecast_containers(docs: list[dict]) -> dict[str, tuple[dict, dict]]:
    """service name → (Deployment, container) for the registry, trainer and rollout."""
    found: dict[str, tuple[dict, dict]] = {}
    for doc in docs:
        if doc["kind"] != "Deployment":
            continue
        for container in doc["spec"]["template"]["spec"]["containers"]:
            command = container.get("command", [])
            if command[:2] == ["python", "-m"] and command[2].startswith("services."):
                found[command[2].removeprefix("services.")] = (doc, container)
    return found


def check_manifests(docs: list[dict], *, gpu: bool, trainer_gpu: bool = False) -> None:
    for doc in docs:
        kubernetes_validate.validate(doc, K8S_VERSION, strict=True)

    by_kind: dict[str, dict[str, dict]] = {}
    for doc in docs:
        by_kind.setdefault(doc["kind"], {})[doc["metadata"]["name"]] = doc

    services = sparsecast_containers(docs)
    assert set(services) == set(SERVICES)
    for name, (deployment, container) in services.items():
        module_main = ROOT / "services" / name / "__main__.py"
        assert module_main.is_file(), f"{module_main.relative_to(ROOT)} is missing"
        ports = {port["name"]: port["containerPort"] for port in container["ports"]}
        env = container_env(container)
        assert ports["http"] == SERVICES[name] == int(env["SPARSECAST_PORT"]), name
        assert container["livenessProbe"]["httpGet"] == {"path": "/healthz", "port": "http"} or (
            container["livenessProbe"]["httpGet"] == {"path": "/healthz", "port": SERVICES[name]}
        ), name
        assert container["readinessProbe"]["httpGet"]["path"] == "/readyz", name
        assert container["startupProbe"]["httpGet"]["path"] == "/healthz", name
        assert deployment["spec"]["template"]["spec"]["securityContext"]["runAsNonRoot"] is True
        # The images listen on 0.0.0.0, where a service refuses to start without a token: each
        # takes its own credentials from the Secret (never a literal), and no other ones.
        held = {k: v for k, v in secret_env(container).items() if k not in STORE_KEYS or name != "registry"}
        assert held == CREDENTIALS[name], name
        assert not {"SPARSECAST_API_TOKEN", "SPARSECAST_PUBLISH_TOKEN", "SPARSECAST_WORKER_TOKEN"} & {
            e["name"] for e in container.get("env", []) if "value" in e}, name

    _, rollout = services["rollout"]
    limits = rollout["resources"].get("limits", {})
    env = container_env(rollout)
    if gpu:
        assert int(limits["nvidia.com/gpu"]) >= 1
        assert rollout["image"].endswith("-cuda")
        assert env["SPARSECAST_DEVICE"] == "cuda"
    else:
        assert "nvidia.com/gpu" not in limits
        assert rollout["image"].endswith("-cpu")
        assert env["SPARSECAST_DEVICE"] == "cpu"
    _, registry = services["registry"]
    assert "nvidia.com/gpu" not in registry["resources"].get("limits", {})
    assert registry["image"].endswith("-cpu")
    _, trainer = services["trainer"]
    trainer_limits = trainer["resources"].get("limits", {})
    assert ("nvidia.com/gpu" in trainer_limits) == trainer_gpu
    assert trainer["image"].endswith("-cuda" if trainer_gpu else "-cpu")
    assert container_env(trainer)["SPARSECAST_DEVICE"] == ("cuda" if trainer_gpu else "cpu")

    check_references(docs, by_kind)


def check_references(docs: list[dict], by_kind: dict[str, dict[str, dict]]) -> None:
    secrets = {
        name: set(secret.get("data", {})) | set(secret.get("stringData", {}))
        for name, secret in by_kind.get("Secret", {}).items()
    }
    configmaps = set(by_kind.get("ConfigMap", {}))
    for deployment in by_kind.get("Deployment", {}).values():
        pod = deployment["spec"]["template"]["spec"]
        labels = deployment["spec"]["template"]["metadata"]["labels"]
        assert deployment["spec"]["selector"]["matchLabels"].items() <= labels.items()
        for container in pod.get("initContainers", []) + pod["containers"]:
            for source in container.get("envFrom", []):
                assert source["configMapRef"]["name"] in configmaps
            for entry in container.get("env", []):
                ref = entry.get("valueFrom", {}).get("secretKeyRef")
                if ref:
                    assert ref["key"] in secrets[ref["name"]], f"{ref['name']} has no {ref['key']}"
        for volume in pod.get("volumes", []):
            if claim := volume.get("persistentVolumeClaim"):
                assert claim["claimName"] in by_kind.get("PersistentVolumeClaim", {})
    for service in by_kind.get("Service", {}).values():
        targets = [
            d for d in by_kind["Deployment"].values()
            if service["spec"]["selector"].items() <= d["spec"]["template"]["metadata"]["labels"].items()
        ]
        assert len(targets) == 1, f"service {service['metadata']['name']} selects {len(targets)} deployments"
        port_names = {
            p.get("name") for c in targets[0]["spec"]["template"]["spec"]["containers"] for p in c["ports"]
        }
        for port in service["spec"]["ports"]:
            assert port["targetPort"] in port_names or isinstance(port["targetPort"], int)


# ids avoid the bare word "gpu": conftest skips tests carrying that keyword without CUDA.
@pytest.mark.parametrize("overlay", ["cpu", "gpu"], ids=["overlay_cpu", "overlay_gpu"])
def test_kustomize_overlay_renders_valid_manifests(overlay: str) -> None:
    docs = kubectl_kustomize(overlay)
    check_manifests(docs, gpu=overlay == "gpu")
    assert {doc["metadata"].get("namespace") for doc in docs if doc["kind"] != "Namespace"} == {"sparsecast"}


def test_kubernetes_validate_rejects_a_broken_manifest() -> None:
    # The schema check is real: a misspelled field fails it.
    docs = kubectl_kustomize("cpu")
    deployment = copy.deepcopy(next(d for d in docs if d["kind"] == "Deployment"))
    deployment["spec"]["template"]["spec"]["containers"][0]["livenessProbe"]["httpGett"] = {}
    with pytest.raises(kubernetes_validate.ValidationError):
        kubernetes_validate.validate(deployment, K8S_VERSION, strict=True)


def test_chart_default_and_gpu_values_match_the_schema() -> None:
    schema = json.loads((CHART / "values.schema.json").read_text())
    jsonschema.Draft7Validator.check_schema(schema)
    assert values_errors(load_values()) == []
    assert values_errors(load_values("values-gpu.yaml")) == []


@pytest.mark.parametrize(
    ("change", "reason"),
    [
        ({"rollout": {"engine": "tgi"}}, "unknown engine"),
        ({"rollout": {"kvPolicy": "rkv", "engine": "vllm"}}, "vLLM keeps the whole KV cache"),
        ({"rollout": {"kvBudget": 0}}, "budget below 1"),
        ({"redis": {"bundled": False, "url": ""}}, "no Redis at all"),
        ({"minio": {"bundled": False}, "store": {"url": ""}}, "no object store at all"),
        ({"minio": {"rootPassword": "short"}}, "MinIO needs 8 characters"),
        ({"store": {"url": "ftp://bucket"}}, "unsupported store"),
        ({"trainer": {"port": 70000}}, "port out of range"),
        ({"trainer": {"modle": "x"}}, "typo in a key"),
    ],
)
def test_chart_schema_rejects_bad_values(change: dict, reason: str) -> None:
    values = load_values()
    deep_merge(values, change)
    assert values_errors(values), reason


def test_chart_templates_only_use_values_that_exist() -> None:
    # Without helm on the machine the templates are not rendered; this catches misspelled paths.
    values = load_values()
    templates = sorted((CHART / "templates").rglob("*.yaml")) + sorted((CHART / "templates").glob("*.tpl"))
    templates += [CHART / "templates" / "NOTES.txt"]
    for template in templates:
        for path in re.findall(r"\.Values\.([A-Za-z0-9_.]+)", template.read_text()):
            node = values
            for key in path.rstrip(".").split("."):
                assert isinstance(node, dict) and key in node, f"{template.name}: .Values.{path}"
                node = node[key]


def test_chart_credentials_are_separate_generated_secrets() -> None:
    """One generated credential per role (kept across upgrades through lookup), the bundled
    Redis's password inside the services' SPARSECAST_REDIS_URL, Redis started with requirepass."""
    docs = helm_template()
    [secret] = [d for d in docs if d["kind"] == "Secret"]
    data = secret["stringData"]
    tokens = ["SPARSECAST_API_TOKEN", "SPARSECAST_PUBLISH_TOKEN", "SPARSECAST_WORKER_TOKEN",
              "REGISTRY_API_TOKEN", "ROLLOUT_API_TOKEN", "REDIS_PASSWORD"]
    values = [data[key] for key in tokens]
    assert all(len(v) == 32 for v in values) and len(set(values)) == len(values)
    assert data["SPARSECAST_REDIS_URL"] == f"redis://:{data['REDIS_PASSWORD']}@demo-sparsecast-redis:6379/0"
    [redis] = pod_spec(docs, "redis")["spec"]["containers"]
    assert redis["args"][-2:] == ["--requirepass", "$(REDIS_PASSWORD)"]
    assert secret_env(redis) == {"REDIS_PASSWORD": "REDIS_PASSWORD", "REDISCLI_AUTH": "REDIS_PASSWORD"}
    helpers = (CHART / "templates" / "_helpers.tpl").read_text()
    generated = helpers.split('define "sparsecast.generated"')[1].split("{{- end }}\n{{- end }}")[0]
    assert "randAlphaNum 32" in generated and "lookup" in generated  # random, and kept across upgrades
    given = helm_template(overrides={"auth": {"apiToken": "a" * 20, "publishToken": "p" * 20},
                                     "redis": {"password": "r" * 20}})
    [secret] = [d for d in given if d["kind"] == "Secret"]
    assert secret["stringData"]["SPARSECAST_API_TOKEN"] == "a" * 20
    assert secret["stringData"]["SPARSECAST_PUBLISH_TOKEN"] == "p" * 20
    assert secret["stringData"]["SPARSECAST_REDIS_URL"].startswith(f"redis://:{'r' * 20}@")


def test_chart_renders_both_images_and_every_service() -> None:
    templates = {p.name: p.read_text() for p in (CHART / "templates").glob("*.yaml")}
    for name in SERVICES:
        text = templates[f"{name}.yaml"]
        assert f'command: ["python", "-m", "services.{name}"]' in text
        assert "kind: Service" in text and "kind: Deployment" in text
    assert "nvidia.com/gpu" in templates["rollout.yaml"]
    assert ".Values.cudaImage" in templates["rollout.yaml"]


@pytest.mark.parametrize("values_file", [None, "values-gpu.yaml"], ids=["default", "values_gpu"])
def test_helm_lint_and_template(values_file: str | None) -> None:
    files = (values_file,) if values_file else ()
    assert helm_lint(chart_values(*files)) == []
    # Every rendered object, the `helm test` hook included, passes strict API validation.
    for doc in helm_template(*files, hooks=True):
        kubernetes_validate.validate(doc, K8S_VERSION, strict=True)
    check_manifests(helm_template(*files), gpu=values_file is not None, trainer_gpu=values_file is not None)


def test_helm_lint_reports_a_broken_values_file() -> None:
    # The lint is real: values the schema refuses are findings.
    assert helm_lint(chart_values(overrides={"rollout": {"engine": "tgi"}}))


@pytest.mark.parametrize("url, options, secret_options", [
    ("s3://bucket/runs", {"endpoint": "https://s3.example", "region": "eu-west-1"},
     {"access_key_id": "AK", "secret_access_key": "SK"}),
    # A store the chart has no line for: only the URL and the options change.
    ("gs://bucket/runs", {}, {"service_account_key": "{}"}),
])
def test_helm_template_with_external_redis_and_store(url: str, options: dict, secret_options: dict) -> None:
    docs = helm_template(overrides={
        "redis": {"bundled": False, "url": "redis://redis.example:6379/0"},
        "minio": {"bundled": False},
        "store": {"url": url, "options": options, "secretOptions": secret_options},
    })
    for doc in docs:
        kubernetes_validate.validate(doc, K8S_VERSION, strict=True)
    names = {doc["metadata"]["name"] for doc in docs}
    assert not any(name.endswith(("-redis", "-minio")) for name in names)
    config = next(doc for doc in docs if doc["kind"] == "ConfigMap")
    assert config["data"]["SPARSECAST_STORE_URL"] == url
    plain = {f"SPARSECAST_STORE_OPTIONS__{key.upper()}": value for key, value in options.items()}
    assert {k: v for k, v in config["data"].items() if "STORE_OPTIONS" in k} == plain
    secret = next(doc for doc in docs if doc["kind"] == "Secret")
    credentials = {f"SPARSECAST_STORE_OPTIONS__{key.upper()}": v for key, v in secret_options.items()}
    assert {k: v for k, v in secret["stringData"].items() if "STORE_OPTIONS" in k} == credentials
    registry = next(
        d for d in docs if d["kind"] == "Deployment" and d["metadata"]["name"].endswith("-registry")
    )
    env = registry["spec"]["template"]["spec"]["containers"][0]["env"]
    from_secret = {e["name"] for e in env if "valueFrom" in e and "STORE_OPTIONS" in e["name"]}
    assert from_secret == set(credentials)


def check_redis_persists(docs: list[dict]) -> None:
    """Redis runs with an append-only file on a PersistentVolumeClaim (issue 13): a restarted pod
    keeps queues, leases and completions."""
    by_kind: dict[str, dict[str, dict]] = {}
    for doc in docs:
        by_kind.setdefault(doc["kind"], {})[doc["metadata"]["name"]] = doc
    [redis] = [d for name, d in by_kind["Deployment"].items() if name.endswith("-redis")]
    pod = redis["spec"]["template"]["spec"]
    [container] = pod["containers"]
    args = container["args"]
    assert args[args.index("--appendonly") + 1] == "yes", args
    assert {"name": "data", "mountPath": "/data"} in container["volumeMounts"]
    [volume] = [v for v in pod["volumes"] if v["name"] == "data"]
    assert volume["persistentVolumeClaim"]["claimName"] in by_kind["PersistentVolumeClaim"]
    assert redis["spec"]["strategy"]["type"] == "Recreate"


@pytest.mark.parametrize("overlay", ["cpu", "gpu"], ids=["overlay_cpu", "overlay_gpu"])
def test_kustomize_redis_keeps_an_aof_on_a_volume(overlay: str) -> None:
    check_redis_persists(kubectl_kustomize(overlay))


def test_helm_redis_keeps_an_aof_on_a_volume() -> None:
    check_redis_persists(helm_template())




def by_kind_and_name(docs: list[dict]) -> dict[tuple[str, str], dict]:
    return {(doc["kind"], doc["metadata"]["name"]): doc for doc in docs}


def pod_spec(docs: list[dict], component: str) -> dict:
    [deployment] = [d for d in docs
                    if d["kind"] == "Deployment" and d["metadata"]["name"].endswith(f"-{component}")]
    return deployment["spec"]["template"]


def check_crd_objects_and_validate(docs: list[dict]) -> None:
    """Strict API validation for every object; a ServiceMonitor (a CRD kubernetes-validate does not
    know) is checked for the fields the Prometheus Operator reads."""
    for doc in docs:
        if doc["kind"] == "ServiceMonitor":
            assert doc["apiVersion"] == "monitoring.coreos.com/v1"
            assert set(doc["spec"]) == {"selector", "namespaceSelector", "endpoints"}
            continue
        kubernetes_validate.validate(doc, K8S_VERSION, strict=True)


OPERATOR_VALUES = {
    "model": {"source": "hf",
              "hf": {"repo": "Qwen/Qwen3-1.7B", "tokenSecret": {"name": "hf-token", "key": "HF_TOKEN"}}},
    "trainer": {"gpu": {"enabled": True, "count": 2}},
    "rollout": {"autoscaling": {"enabled": True, "minReplicas": 2, "maxReplicas": 6, "queuedPerWorker": 8}},
    "ingress": {"enabled": True, "className": "nginx", "host": "rl.example.com", "tlsSecret": "rl-tls"},
    "metrics": {"serviceMonitor": {"enabled": True, "labels": {"release": "prometheus"}}},
}


def test_chart_operator_options_render_valid_objects() -> None:
    assert values_errors(chart_values("values.yaml", overrides=OPERATOR_VALUES)) == []
    assert helm_lint(chart_values(overrides=OPERATOR_VALUES)) == []
    docs = helm_template(overrides=OPERATOR_VALUES)
    check_crd_objects_and_validate(docs)
    objects = by_kind_and_name(docs)

    # Model provisioning: an init container downloads into a claim the trainer mounts read-only.
    trainer = pod_spec(docs, "trainer")["spec"]
    [init] = trainer["initContainers"]
    assert init["command"][:3] == ["python", "-m", "services.trainer.fetch_model"]
    assert init["command"][init["command"].index("--hf") + 1] == "Qwen/Qwen3-1.7B"
    token = next(e for e in init["env"] if e["name"] == "HF_TOKEN")
    assert token["valueFrom"]["secretKeyRef"] == {"name": "hf-token", "key": "HF_TOKEN"}
    [container] = trainer["containers"]
    assert container_env(container)["SPARSECAST_MODEL"] == "/models/current"
    assert {"name": "models", "mountPath": "/models", "readOnly": True} in container["volumeMounts"]
    [models] = [v for v in trainer["volumes"] if v["name"] == "models"]
    assert ("PersistentVolumeClaim", models["persistentVolumeClaim"]["claimName"]) in objects
    # The trainer on GPUs.
    assert container["resources"]["limits"]["nvidia.com/gpu"] == 2 and container["image"].endswith("-cuda")
    assert {"key": "nvidia.com/gpu", "operator": "Exists", "effect": "NoSchedule"} in trainer["tolerations"]

    # Autoscaling replaces the fixed replica count.
    rollout = objects[("Deployment", "demo-sparsecast-rollout")]
    assert "replicas" not in rollout["spec"]
    hpa = objects[("HorizontalPodAutoscaler", "demo-sparsecast-rollout")]
    target = {"apiVersion": "apps/v1", "kind": "Deployment", "name": "demo-sparsecast-rollout"}
    assert hpa["spec"]["scaleTargetRef"] == target
    [metric] = hpa["spec"]["metrics"]
    queued = {"name": "coord", "selector": {"matchLabels": {"name": "prompts_queued"}}}
    assert metric["external"]["metric"] == queued
    assert (hpa["spec"]["minReplicas"], hpa["spec"]["maxReplicas"]) == (2, 6)

    # The Ingress reaches the trainer's Service on a port it has.
    ingress = objects[("Ingress", "demo-sparsecast-trainer")]
    backend = ingress["spec"]["rules"][0]["http"]["paths"][0]["backend"]["service"]
    service = objects[("Service", backend["name"])]
    assert backend["port"]["name"] in {p["name"] for p in service["spec"]["ports"]}
    assert ingress["spec"]["tls"] == [{"hosts": ["rl.example.com"], "secretName": "rl-tls"}]

    # The ServiceMonitor selects exactly the three sparsecast Services, on their http port.
    monitor = objects[("ServiceMonitor", "demo-sparsecast")]
    assert monitor["metadata"]["labels"]["release"] == "prometheus"
    selected = {
        name for (kind, name), doc in objects.items() if kind == "Service" and all(
            doc["metadata"]["labels"].get(rule["key"]) in rule["values"]
            for rule in monitor["spec"]["selector"]["matchExpressions"])
    }
    assert selected == {f"demo-sparsecast-{name}" for name in SERVICES}
    assert monitor["spec"]["endpoints"] == [{"port": "http", "path": "/metrics", "interval": "30s"}]


@pytest.mark.parametrize(
    ("model", "command", "claim", "path"),
    [
        ({"source": "url", "url": "https://models.example/qwen3.tar.gz"},
         ["--url", "https://models.example/qwen3.tar.gz"], "demo-sparsecast-models", "/models/current"),
        ({"source": "volume", "existingClaim": "shared-models", "subPath": "Qwen3-1.7B"},
         None, "shared-models", "/models/Qwen3-1.7B"),
    ],
    ids=["url", "volume"],
)
def test_chart_model_from_a_url_or_a_filled_volume(model: dict, command: list | None, claim: str,
                                                   path: str) -> None:
    docs = helm_template(overrides={"model": model})
    check_crd_objects_and_validate(docs)
    trainer = pod_spec(docs, "trainer")["spec"]
    if command:
        [init] = trainer["initContainers"]
        assert init["command"][-2:] == command
    else:
        assert "initContainers" not in trainer
        assert ("PersistentVolumeClaim", "demo-sparsecast-models") not in by_kind_and_name(docs)
    [models] = [v for v in trainer["volumes"] if v["name"] == "models"]
    assert models["persistentVolumeClaim"]["claimName"] == claim
    assert container_env(trainer["containers"][0])["SPARSECAST_MODEL"] == path


@pytest.mark.parametrize(
    "change",
    [
        {"model": {"source": "hf"}},
        {"model": {"source": "url", "url": "ftp://x/y.tar"}},
        {"model": {"source": "volume"}},
        {"model": {"source": "s3"}},
        {"ingress": {"enabled": True, "host": ""}},
        {"rollout": {"autoscaling": {"enabled": True, "minReplicas": 0}}},
        {"metrics": {"serviceMonitor": {"interval": "often"}}},
    ],
    ids=["hf_without_repo", "url_not_http", "volume_without_claim", "unknown_source", "ingress_without_host",
         "autoscaling_min_0", "bad_interval"],
)
def test_chart_schema_rejects_bad_operator_values(change: dict) -> None:
    values = load_values()
    deep_merge(values, change)
    assert values_errors(values)


def test_chart_default_pods_spread_survive_drains_and_are_scraped() -> None:
    docs = helm_template()
    objects = by_kind_and_name(docs)
    template = pod_spec(docs, "rollout")
    labels = template["metadata"]["labels"]
    pdb = objects[("PodDisruptionBudget", "demo-sparsecast-rollout")]
    assert pdb["spec"]["selector"]["matchLabels"].items() <= labels.items()
    assert pdb["spec"]["maxUnavailable"] == 1
    [spread] = template["spec"]["topologySpreadConstraints"]
    assert spread["labelSelector"]["matchLabels"].items() <= labels.items()
    assert (spread["topologyKey"], spread["whenUnsatisfiable"]) == (
        "kubernetes.io/hostname",
        "ScheduleAnyway",
    )
    for name, port in SERVICES.items():
        annotations = pod_spec(docs, name)["metadata"]["annotations"]
        assert annotations["prometheus.io/scrape"] == "true"
        scrape = (annotations["prometheus.io/port"], annotations["prometheus.io/path"])
        assert scrape == (str(port), "/metrics")


def test_a_changed_token_secret_restarts_the_pods() -> None:
    def checksums(overrides: dict) -> dict[str, str | None]:
        docs = helm_template(overrides=overrides)
        return {name: pod_spec(docs, name)["metadata"]["annotations"].get("checksum/secret")
                for name in SERVICES}

    tokens = ("token-one", "token-one", "token-two")
    first, again, changed = (checksums({"auth": {"apiToken": t}}) for t in tokens)
    assert all(first.values()) and first == again
    assert all(first[name] != changed[name] for name in SERVICES)
    # An existing Secret is the operator's: the chart cannot see it change.
    assert set(checksums({"auth": {"existingSecret": "mine"}}).values()) == {None}


@pytest.mark.parametrize(("cpu", "threads"), [("2", "2"), (3, "3"), ("1500m", "1"), ("250m", "1")])
def test_omp_threads_follow_the_cpu_limit(cpu: str | int, threads: str) -> None:
    docs = helm_template(overrides={"rollout": {"resources": {"limits": {"cpu": cpu}}}})
    assert container_env(pod_spec(docs, "rollout")["spec"]["containers"][0])["OMP_NUM_THREADS"] == threads
    for name in SERVICES:  # every sparsecast container has a CPU limit by default, so a thread count
        [container] = pod_spec(docs, name)["spec"]["containers"]
        assert container["resources"]["limits"]["cpu"]
        assert int(container_env(container)["OMP_NUM_THREADS"]) >= 1
    given = helm_template(overrides={"rollout": {"extraEnv": [{"name": "OMP_NUM_THREADS", "value": "7"}]}})
    env = pod_spec(given, "rollout")["spec"]["containers"][0]["env"]
    assert [e["value"] for e in env if e["name"] == "OMP_NUM_THREADS"] == ["7"]


def test_notes_show_how_to_submit_prompts() -> None:
    notes = helm_notes()
    assert "sparsecast submit --task addition" in notes and "/v1/prompts" in notes
    assert "port-forward svc/demo-sparsecast-trainer 8000:8000" in notes
    ingress = helm_notes(overrides={"ingress": {"enabled": True, "host": "rl.example.com", "tlsSecret": "t"}})
    assert "SPARSECAST_TRAINER_URL=https://rl.example.com" in ingress


DISTRIBUTED = {"trainer": {"distributed": {"enabled": True, "dataClaim": "shared-data"}}}


@pytest.mark.parametrize(
    ("change", "valid"),
    [
        (DISTRIBUTED, True),
        ({"trainer": {"distributed": {"enabled": True}}}, False),  # no shared volume for the shards
        ({"trainer": {"distributed": {"enabled": True, "dataClaim": "d", "nnodes": 0}}}, False),
        ({"trainer": {"distributed": {"enabled": True, "dataClaim": "d", "nprocPerNode": 0}}}, False),
        ({"trainer": {"distributed": {"enabled": True, "dataClaim": "d", "gpus": 8}}}, False),
    ],
)
def test_chart_schema_for_the_distributed_trainer(change: dict, valid: bool) -> None:
    values = load_values()
    deep_merge(values, copy.deepcopy(change))
    assert (values_errors(values) == []) is valid


def test_helm_template_distributed_trainer() -> None:
    """A torchrun StatefulSet found through a headless Service, GPUs per pod, node rank from the pod
    index; the trainer Deployment steps aside and the API Service reaches node rank 0 only."""
    overrides = {"trainer": {"distributed": {"enabled": True, "dataClaim": "shared", "nnodes": 3,
                                             "nprocPerNode": 4}}}
    assert helm_lint(chart_values(overrides=overrides)) == []
    docs = helm_template(overrides=overrides)
    check_crd_objects_and_validate(docs)
    assert load_values()["trainer"]["distributed"]["enabled"] is False
    assert not any(d["kind"] == "Deployment" and d["metadata"]["name"].endswith("-trainer") for d in docs)
    [sts] = [d for d in docs if d["kind"] == "StatefulSet"]
    assert sts["spec"]["replicas"] == 3 and sts["spec"]["podManagementPolicy"] == "Parallel"
    [container] = sts["spec"]["template"]["spec"]["containers"]
    assert container["command"] == ["torchrun"] and container["args"][-2:] == ["-m", "services.trainer"]
    assert {"--nnodes=3", "--nproc_per_node=4", "--node_rank=$(NODE_RANK)"} <= set(container["args"])
    assert int(container["resources"]["limits"]["nvidia.com/gpu"]) == 4
    node_rank = next(e for e in container["env"] if e["name"] == "NODE_RANK")
    assert (
        node_rank["valueFrom"]["fieldRef"]["fieldPath"] == "metadata.labels['apps.kubernetes.io/pod-index']"
    )
    services = {d["metadata"]["name"]: d for d in docs if d["kind"] == "Service"}
    headless = services[sts["spec"]["serviceName"]]["spec"]
    assert headless["clusterIP"] == "None" and headless["publishNotReadyAddresses"] is True
    selector = services["demo-sparsecast-trainer"]["spec"]["selector"]
    assert selector["statefulset.kubernetes.io/pod-name"].endswith("-0")
