"""Kubernetes: kustomize overlays rendered by kubectl and validated against the API schemas, the
Helm chart's values against values.schema.json, and `helm lint`/`helm template` where helm exists.

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
from pathlib import Path

import jsonschema
import kubernetes_validate
import pytest
import yaml

ROOT = Path(__file__).resolve().parents[2]
KUSTOMIZE = ROOT / "k8s" / "kustomize"
CHART = ROOT / "k8s" / "helm" / "sparsecast"
K8S_VERSION = "1.32.0"  # a version every current managed Kubernetes offers
SERVICES = {"registry": 8100, "trainer": 8000, "rollout": 8200}


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


def helm(*args: str) -> subprocess.CompletedProcess[str]:
    if shutil.which("helm") is None:
        pytest.skip("helm is not installed")
    return subprocess.run(["helm", *args], capture_output=True, text=True, timeout=120)


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


def check_manifests(docs: list[dict], *, gpu: bool) -> None:
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
        # takes it from the Secret, never from a literal in the manifest.
        token = next(e for e in container["env"] if e["name"] == "SPARSECAST_API_TOKEN")
        assert token["valueFrom"]["secretKeyRef"]["key"] == "SPARSECAST_API_TOKEN" and "value" not in token, name

    _, rollout = services["rollout"]
    limits = rollout["resources"].get("limits", {})
    env = container_env(rollout)
    if gpu:
        assert int(limits["nvidia.com/gpu"]) >= 1
        assert rollout["image"].endswith(":cuda")
        assert env["SPARSECAST_DEVICE"] == "cuda"
    else:
        assert "nvidia.com/gpu" not in limits
        assert rollout["image"].endswith(":cpu")
        assert env["SPARSECAST_DEVICE"] == "cpu"
    for name in ("registry", "trainer"):
        assert "nvidia.com/gpu" not in services[name][1]["resources"].get("limits", {})
        assert services[name][1]["image"].endswith(":cpu")

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
        port_names = {p.get("name") for c in targets[0]["spec"]["template"]["spec"]["containers"] for p in c["ports"]}
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
        ({"store": {"url": "gs://bucket"}}, "unsupported store"),
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


def test_chart_takes_the_api_token_from_a_secret_generated_if_not_given() -> None:
    # Static checks of the templates (helm is not on these machines to render them).
    templates = {p.name: p.read_text() for p in (CHART / "templates").glob("*.yaml")}
    helpers = (CHART / "templates" / "_helpers.tpl").read_text()
    for name in SERVICES:
        env = re.search(r'include "sparsecast.env" \(list \. ([^)]*)\)', templates[f"{name}.yaml"])
        assert env and '"SPARSECAST_API_TOKEN"' in env.group(1), name
        assert "SPARSECAST_API_TOKEN" not in templates[f"{name}.yaml"].replace(env.group(0), ""), name
    assert "secretKeyRef" in helpers.split('define "sparsecast.env"')[1]
    secret = templates["secret.yaml"]
    assert re.search(r'SPARSECAST_API_TOKEN: \{\{ \.Values\.auth\.apiToken \| default \(include "sparsecast\.generated"', secret)
    generated = helpers.split('define "sparsecast.generated"')[1].split("{{- end }}\n{{- end }}")[0]
    assert "randAlphaNum 32" in generated and "lookup" in generated  # random, and kept across upgrades
    assert load_values()["auth"] == {"apiToken": "", "existingSecret": ""}


def test_chart_renders_both_images_and_every_service() -> None:
    templates = {p.name: p.read_text() for p in (CHART / "templates").glob("*.yaml")}
    for name in SERVICES:
        text = templates[f"{name}.yaml"]
        assert f'command: ["python", "-m", "services.{name}"]' in text
        assert "kind: Service" in text and "kind: Deployment" in text
    assert "nvidia.com/gpu" in templates["rollout.yaml"]
    assert ".Values.cudaImage" in templates["rollout.yaml"]


@pytest.mark.parametrize("values_file", [None, "values-gpu.yaml"], ids=["default", "values_gpu"])
def test_helm_lint_and_template(values_file: str | None, tmp_path: Path) -> None:
    extra = ["-f", str(CHART / values_file)] if values_file else []
    linted = helm("lint", "--strict", str(CHART), *extra)
    assert linted.returncode == 0, linted.stdout + linted.stderr
    rendered = helm("template", "demo", str(CHART), "--namespace", "sparsecast", *extra)
    assert rendered.returncode == 0, rendered.stderr
    docs = [doc for doc in yaml.safe_load_all(rendered.stdout) if doc]
    # The `helm test` pod is a hook, not part of the stack.
    docs = [d for d in docs if "helm.sh/hook" not in d["metadata"].get("annotations", {})]
    check_manifests(docs, gpu=values_file is not None)


def test_helm_template_with_external_redis_and_s3() -> None:
    rendered = helm(
        "template", "demo", str(CHART),
        "--set", "redis.bundled=false", "--set", "redis.url=redis://redis.example:6379/0",
        "--set", "minio.bundled=false", "--set", "store.url=s3://bucket/runs",
        "--set", "store.s3.endpoint=https://s3.example",
    )
    assert rendered.returncode == 0, rendered.stderr
    docs = [doc for doc in yaml.safe_load_all(rendered.stdout) if doc]
    names = {doc["metadata"]["name"] for doc in docs}
    assert not any(name.endswith(("-redis", "-minio")) for name in names)
    config = next(doc for doc in docs if doc["kind"] == "ConfigMap")
    assert config["data"]["SPARSECAST_STORE_URL"] == "s3://bucket/runs"


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
    rendered = helm("template", "demo", str(CHART), "--namespace", "sparsecast")
    assert rendered.returncode == 0, rendered.stderr
    check_redis_persists([doc for doc in yaml.safe_load_all(rendered.stdout) if doc])


def test_chart_redis_template_mounts_its_claim() -> None:
    # Without helm on the machine: the template reads the persistence values and names its claim.
    text = (CHART / "templates" / "redis.yaml").read_text()
    assert '"--appendonly", "yes"' in text and "kind: PersistentVolumeClaim" in text
    assert text.count('{{ include "sparsecast.fullname" . }}-redis') >= 3  # deployment, claim ref, claim
    assert load_values()["redis"]["persistence"]["enabled"] is True


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


def test_chart_distributed_trainer_template() -> None:
    # Static checks (helm is not on these machines): a torchrun StatefulSet found through a
    # headless Service, GPUs per pod, node rank from the pod index; the Deployment steps aside.
    text = (CHART / "templates" / "trainer-distributed.yaml").read_text()
    assert text.count("{{- if .Values.trainer.distributed.enabled }}") == 1
    for needle in ("kind: StatefulSet", "clusterIP: None", "publishNotReadyAddresses: true",
                   'command: ["torchrun"]', "--nnodes={{ $d.nnodes }}",
                   "--nproc_per_node={{ $d.nprocPerNode }}", "--node_rank=$(NODE_RANK)",
                   "apps.kubernetes.io/pod-index", '"nvidia.com/gpu" $d.nprocPerNode',
                   "- services.trainer", "$d.dataClaim", "podManagementPolicy: Parallel"):
        assert needle in text, needle
    trainer = (CHART / "templates" / "trainer.yaml").read_text()
    assert trainer.splitlines()[1] == "{{- if not .Values.trainer.distributed.enabled }}"
    assert "statefulset.kubernetes.io/pod-name" in trainer  # the API Service reaches node rank 0 only
    assert load_values()["trainer"]["distributed"]["enabled"] is False


def test_helm_template_distributed_trainer() -> None:
    rendered = helm("template", "demo", str(CHART), "--namespace", "sparsecast",
                    "--set", "trainer.distributed.enabled=true",
                    "--set", "trainer.distributed.dataClaim=shared",
                    "--set", "trainer.distributed.nnodes=3", "--set", "trainer.distributed.nprocPerNode=4")
    assert rendered.returncode == 0, rendered.stderr
    docs = [doc for doc in yaml.safe_load_all(rendered.stdout) if doc]
    docs = [d for d in docs if "helm.sh/hook" not in d["metadata"].get("annotations", {})]
    for doc in docs:
        kubernetes_validate.validate(doc, K8S_VERSION, strict=True)
    assert not any(d["kind"] == "Deployment" and d["metadata"]["name"].endswith("-trainer") for d in docs)
    [sts] = [d for d in docs if d["kind"] == "StatefulSet"]
    assert sts["spec"]["replicas"] == 3
    [container] = sts["spec"]["template"]["spec"]["containers"]
    assert container["command"] == ["torchrun"] and container["args"][-2:] == ["-m", "services.trainer"]
    assert "--nproc_per_node=4" in container["args"]
    assert int(container["resources"]["limits"]["nvidia.com/gpu"]) == 4
    services = {d["metadata"]["name"]: d for d in docs if d["kind"] == "Service"}
    assert services[sts["spec"]["serviceName"]]["spec"]["clusterIP"] == "None"
    selector = services["demo-sparsecast-trainer"]["spec"]["selector"]
    assert selector["statefulset.kubernetes.io/pod-name"].endswith("-0")
