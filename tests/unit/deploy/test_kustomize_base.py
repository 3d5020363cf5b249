"""kustomize is the chart (issue 28 row 12): the committed base and GPU patch are what
tests/unit/deploy/kustomize_base.py generates from the chart now, and `kubectl kustomize` of each
overlay renders the chart's objects (PDB, topology spread, scrape annotations, limits,
OMP_NUM_THREADS, probes, NetworkPolicies...) field for field, up to the namespace and the
generated Secret's hash suffix."""

from __future__ import annotations

import re
from typing import Any

import pytest

from tests.unit.deploy import kustomize_base
from tests.unit.deploy.test_deploy_k8s import kubectl_kustomize

SECRET_NAME = re.compile(rf"^{kustomize_base.SECRET}-[a-z0-9]{{10}}$")


def normalized(value: Any) -> Any:
    """Lists of named entries (env, containers, volumes, ports) in name order, the generated
    Secret's name without its hash: what a strategic merge may reorder or kustomize renames."""
    if isinstance(value, dict):
        return {k: normalized(v) for k, v in value.items() if k != "namespace"}
    if isinstance(value, list):
        items = [normalized(v) for v in value]
        if items and all(isinstance(v, dict) and "name" in v for v in items):
            items.sort(key=lambda v: str(v["name"]))
        return items
    if isinstance(value, str) and SECRET_NAME.match(value):
        return kustomize_base.SECRET
    return value


def objects(docs: list[dict]) -> dict[tuple[str, str], dict]:
    return {(d["kind"], d["metadata"]["name"]): normalized(d) for d in docs}


def test_generated_files_are_current() -> None:
    """Fails after a chart change until `make kustomize-base` is run."""
    assert kustomize_base.BASE_FILE.read_text() == kustomize_base.base_text()
    assert kustomize_base.GPU_PATCH_FILE.read_text() == kustomize_base.gpu_patch_text()


@pytest.mark.parametrize("overlay", ["cpu", "gpu"], ids=["overlay_cpu", "overlay_gpu"])
def test_overlay_renders_the_charts_objects(overlay: str) -> None:
    chart = objects(kustomize_base.render(kustomize_base.base_values()))
    if overlay == "gpu":
        rollout = kustomize_base.gpu_rollout_patch()
        chart[("Deployment", rollout["metadata"]["name"])] = normalized(rollout)
    rendered = kubectl_kustomize(overlay)
    got = objects(rendered)
    assert set(chart) <= set(got), set(chart) - set(got)
    for key, expected in chart.items():
        assert got[key] == expected, key
    # What kustomize adds: the namespace and the generated Secret, with every key the pods read.
    extra = {kind for kind, _ in set(got) - set(chart)}
    assert extra == {"Namespace", "Secret"}
    [secret] = [d for d in rendered if d["kind"] == "Secret"]
    wanted = {ref["key"] for d in rendered if d["kind"] in ("Deployment", "StatefulSet")
              for c in [*d["spec"]["template"]["spec"].get("initContainers", []),
                        *d["spec"]["template"]["spec"]["containers"]]
              for e in c.get("env", []) if (ref := e.get("valueFrom", {}).get("secretKeyRef"))}
    assert wanted <= set(secret["data"]), wanted - set(secret["data"])


def test_the_objects_issue_28_found_missing_are_there() -> None:
    got = objects(kubectl_kustomize("cpu"))
    assert ("PodDisruptionBudget", "sparsecast-rollout") in got
    rollout = got[("Deployment", "sparsecast-rollout")]["spec"]["template"]
    assert rollout["spec"]["topologySpreadConstraints"]
    assert rollout["metadata"]["annotations"]["prometheus.io/scrape"] == "true"
    [container] = rollout["spec"]["containers"]
    assert {"cpu", "memory"} <= set(container["resources"]["limits"])
    assert any(e["name"] == "OMP_NUM_THREADS" for e in container["env"])
    assert ("NetworkPolicy", "sparsecast-redis") in got


def test_a_changed_chart_is_caught(monkeypatch: pytest.MonkeyPatch) -> None:
    real = kustomize_base.render

    def changed(values: dict) -> list[dict]:
        docs = real(values)
        for doc in docs:
            if doc["kind"] == "PodDisruptionBudget":
                doc["spec"]["maxUnavailable"] = 2
        return docs

    monkeypatch.setattr(kustomize_base, "render", changed)
    assert kustomize_base.BASE_FILE.read_text() != kustomize_base.base_text()
