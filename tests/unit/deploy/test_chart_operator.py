"""The chart as an operator upgrades and locks it down (issue 28 rows 9-11, issue 27's Kubernetes
half): versioned image tags and digest pinning, the GPU trainer's own resources, no unused claim
under the distributed trainer, probes for the distributed StatefulSet, and NetworkPolicies that
keep Redis and MinIO to the pods that need them."""

from __future__ import annotations

import kubernetes_validate
import pytest
import yaml

from tests.unit.deploy.test_deploy_k8s import (
    CHART,
    K8S_VERSION,
    OPERATOR_VALUES,
    helm_lint,
    helm_template,
    load_values,
    pod_spec,
    values_errors,
)

APP_VERSION = yaml.safe_load((CHART / "Chart.yaml").read_text())["appVersion"]
DIGEST = "sha256:" + "ab" * 32


def images(docs: list[dict]) -> dict[str, tuple[str, str]]:
    """container name → (image, imagePullPolicy) over every pod."""
    found = {}
    for doc in docs:
        spec = doc.get("spec", {})
        pod = spec if doc["kind"] == "Pod" else spec.get("template", {}).get("spec")
        for c in [*(pod or {}).get("initContainers", []), *(pod or {}).get("containers", [])]:
            found[c["name"]] = (c["image"], c.get("imagePullPolicy"))
    return found


def test_images_default_to_the_chart_version_and_pin_by_digest() -> None:
    used = images(helm_template(hooks=True))
    for name in ("registry", "trainer", "rollout", "readyz"):
        assert used[name] == (f"sparsecast:{APP_VERSION}-cpu", "IfNotPresent"), name
    # Third-party images carry a full version, never a moving minor tag.
    assert used["redis"][0].split(":")[1].count(".") == 2 and used["redis"][1] == "IfNotPresent"
    assert "RELEASE." in used["minio"][0] and "RELEASE." in used["create-bucket"][0]
    gpu = images(helm_template("values-gpu.yaml"))
    assert gpu["rollout"][0] == gpu["trainer"][0] == f"sparsecast:{APP_VERSION}-cuda"
    pinned = images(helm_template(overrides={"image": {"repository": "r.example/sc", "digest": DIGEST},
                                             "cudaImage": {"tag": "1.2.3-cuda"}}))
    assert pinned["registry"][0] == f"r.example/sc:{APP_VERSION}-cpu@{DIGEST}"
    assert values_errors({**load_values(), "image": {"repository": "x", "digest": "latest"}})


def test_gpu_trainer_has_resources_of_its_own() -> None:
    values = load_values()
    trainer = pod_spec(helm_template(overrides=OPERATOR_VALUES), "trainer")["spec"]
    [container] = trainer["containers"]
    gpu_resources = values["trainer"]["gpu"]["resources"]
    assert container["resources"]["limits"] == {**gpu_resources["limits"], "nvidia.com/gpu": 2}
    assert container["resources"]["requests"] == gpu_resources["requests"]
    assert gpu_resources["limits"]["memory"] != values["trainer"]["resources"]["limits"]["memory"]
    omp = {e["name"]: e.get("value") for e in container["env"]}["OMP_NUM_THREADS"]
    assert omp == str(int(gpu_resources["limits"]["cpu"]))


def test_distributed_trainer_has_probes_and_no_unused_claim() -> None:
    overrides = {"trainer": {"distributed": {"enabled": True, "dataClaim": "shared"}}}
    assert helm_lint({**overrides}) == []
    docs = helm_template(overrides=overrides)
    claims = [d["metadata"]["name"] for d in docs if d["kind"] == "PersistentVolumeClaim"]
    assert not any(name.endswith("-trainer") for name in claims), claims
    [sts] = [d for d in docs if d["kind"] == "StatefulSet"]
    [container] = sts["spec"]["template"]["spec"]["containers"]
    startup_s = load_values()["trainer"]["distributed"]["startupSeconds"]
    probe = container["startupProbe"]
    assert probe["periodSeconds"] * probe["failureThreshold"] == startup_s >= 1800
    probes = {"startupProbe": "/healthz", "livenessProbe": "/healthz", "readinessProbe": "/readyz"}
    for name, path in probes.items():
        command = container[name]["exec"]["command"]
        # Node 0 serves HTTP; every other node passes (torchrun ends the job when any rank dies).
        assert command[:2] == ["sh", "-c"] and command[2].endswith(f"healthcheck.py {path}"), name
        assert 'test "$NODE_RANK" != 0 ||' in command[2]


def test_trainer_start_is_covered_by_liveness_not_a_long_startup_probe() -> None:
    """/healthz is 200 while the warm start or model load progresses (services.trainer.service),
    so the startup probe only waits for HTTP, and the liveness probe restarts a stalled start."""
    [container] = pod_spec(helm_template(), "trainer")["spec"]["containers"]
    probe = container["startupProbe"]
    assert probe["httpGet"]["path"] == "/healthz"
    assert probe["periodSeconds"] * probe["failureThreshold"] == load_values()["trainer"]["startupSeconds"]
    assert container["livenessProbe"]["httpGet"]["path"] == "/healthz"


def policies(docs: list[dict]) -> dict[str, dict]:
    return {d["metadata"]["name"].removeprefix("demo-sparsecast-"): d["spec"] for d in docs
            if d["kind"] == "NetworkPolicy"}


def components(peers: list[dict]) -> set[str]:
    return {p["podSelector"]["matchLabels"].get("app.kubernetes.io/component", "*") for p in peers}


@pytest.mark.parametrize("overrides", [{}, {"trainer": {"distributed": {"enabled": True, "dataClaim": "x"}}}],
                         ids=["default", "distributed"])
def test_network_policies_deny_by_default_and_fence_redis_and_minio(overrides: dict) -> None:
    docs = helm_template(overrides=overrides)
    for doc in docs:
        if doc["kind"] == "NetworkPolicy":
            kubernetes_validate.validate(doc, K8S_VERSION, strict=True)
    found = policies(docs)
    deny = found["default-deny"]
    assert deny["policyTypes"] == ["Ingress"] and "ingress" not in deny
    assert deny["podSelector"]["matchLabels"]["app.kubernetes.io/instance"] == "demo"
    redis = found["redis"]
    [rule] = redis["ingress"]
    assert components(rule["from"]) == {"registry", "trainer", "rollout"}
    assert rule["ports"] == [{"port": 6379}] and redis["egress"] == []
    [rule] = found["minio"]["ingress"]
    assert components(rule["from"]) == {"registry"} and found["minio"]["egress"] == []
    for name, port in (("registry", 8100), ("rollout", 8200)):
        [rule] = found[name]["ingress"]
        assert rule["ports"] == [{"port": port}]
        assert rule["from"] == [{"podSelector": {"matchLabels": {"app.kubernetes.io/instance": "demo"}}}]
    trainer_rules = found["trainer"]["ingress"]
    assert trainer_rules[0] == {"ports": [{"port": 8000}]}  # the API and dashboard, token-protected
    assert len(trainer_rules) == (2 if overrides else 1)  # distributed: the nodes reach each other
    # Every pod of the release is under the default deny (the selector's labels are on each).
    for doc in docs:
        if doc["kind"] in ("Deployment", "StatefulSet"):
            labels = doc["spec"]["template"]["metadata"]["labels"]
            assert deny["podSelector"]["matchLabels"].items() <= labels.items(), doc["metadata"]["name"]


def test_network_policies_can_admit_more_peers_or_be_off() -> None:
    monitoring = {"namespaceSelector": {"matchLabels": {"name": "monitoring"}}}
    found = policies(helm_template(overrides={"networkPolicy": {"allowedFrom": [monitoring]}}))
    assert monitoring in found["registry"]["ingress"][0]["from"]
    assert not policies(helm_template(overrides={"networkPolicy": {"enabled": False}}))
    external = policies(helm_template(overrides={"redis": {"bundled": False, "url": "redis://r:6379/0"}}))
    assert "redis" not in external


@pytest.mark.parametrize("overrides", [{}, OPERATOR_VALUES], ids=["default", "operator"])
def test_read_only_pods_have_their_writable_paths(overrides: dict) -> None:
    """Under a read-only root, every container writes only to volumes: /tmp (and $HOME, pointed
    there by the ConfigMap) for all of them, /data for the services."""
    docs = helm_template(overrides=overrides, hooks=True)
    [config] = [d for d in docs if d["kind"] == "ConfigMap"]
    assert config["data"]["HOME"] == "/tmp"
    for doc in docs:
        spec = doc.get("spec", {})
        pod = spec if doc["kind"] == "Pod" else spec.get("template", {}).get("spec")
        if not pod:
            continue
        volumes = {v["name"]: v for v in pod.get("volumes", [])}
        for c in [*pod.get("initContainers", []), *pod["containers"]]:
            if c["name"] in ("redis", "readyz"):
                continue  # Redis writes /data only; the test pod writes nothing
            mounts = {m["mountPath"]: m["name"] for m in c.get("volumeMounts", [])}
            assert "emptyDir" in volumes[mounts["/tmp"]], (doc["metadata"]["name"], c["name"])
            if c["name"] in ("registry", "trainer", "rollout"):
                assert "/data" in mounts, c["name"]
