"""The kustomize manifests, generated from the Helm chart so the two cannot drift (issue 28 row 12).

    python -m tests.unit.deploy.kustomize_base     # (make kustomize-base) rewrites the files below

k8s/kustomize/base/sparsecast.yaml is the chart rendered with its default values, release
"sparsecast", the credentials taken from the Secret that the base's secretGenerator makes
(auth.existingSecret), without Helm's own labels and the `helm test` hook. The GPU overlay's
rollout patch is the chart's rollout Deployment under values-gpu.yaml's rollout values.
tests/unit/deploy/test_kustomize_base.py checks both files are current and that `kubectl
kustomize` of each overlay equals the chart's rendering object for object.
"""

from __future__ import annotations

import copy
import re
from pathlib import Path

import helm_python
import yaml

from tests.paths import REPO_ROOT

CHART = REPO_ROOT / "k8s" / "helm" / "sparsecast"
KUSTOMIZE = REPO_ROOT / "k8s" / "kustomize"
BASE_FILE = KUSTOMIZE / "base" / "sparsecast.yaml"
GPU_PATCH_FILE = KUSTOMIZE / "overlays" / "gpu" / "rollout-gpu.yaml"
RELEASE = "sparsecast"
SECRET = "sparsecast-secrets"  # the base's secretGenerator
# Labels that say Helm manages an object: not true of `kubectl apply -k`.
HELM_LABELS = ("helm.sh/chart", "app.kubernetes.io/managed-by")
HEADER = """# GENERATED from the Helm chart (k8s/helm/sparsecast) by `make kustomize-base`
# (tests/unit/deploy/kustomize_base.py): do not edit; change the chart and regenerate.
# tests/unit/deploy/test_kustomize_base.py fails when this file is not current.
"""


# Scalars a YAML 1.2 reader (kustomize) takes for numbers, booleans or null where PyYAML's 1.1
# rules write them bare: such strings are quoted, or "5e-5" would come back as 5e-05.
YAML12_NON_STRING = re.compile(
    r"[-+]?(\.[0-9]+|[0-9]+(\.[0-9]*)?)([eE][-+]?[0-9]+)?|0x[0-9a-fA-F]+|0o[0-7]+|[-+]?\.(inf|Inf|INF)"
    r"|\.(nan|NaN|NAN)|true|True|TRUE|false|False|FALSE|null|Null|NULL|~|")


class _Dumper(yaml.SafeDumper):
    pass


def _str(dumper: yaml.SafeDumper, value: str) -> yaml.ScalarNode:
    style = "'" if YAML12_NON_STRING.fullmatch(value) else ("|" if "\n" in value else None)
    return dumper.represent_scalar("tag:yaml.org,2002:str", value, style=style)


_Dumper.add_representer(str, _str)


def dump(docs: list[dict]) -> str:
    return yaml.dump_all(docs, Dumper=_Dumper, sort_keys=False, width=110)


def base_values() -> dict:
    return {"fullnameOverride": RELEASE, "auth": {"existingSecret": SECRET}}


def gpu_rollout_values() -> dict:
    values = base_values()
    values["rollout"] = yaml.safe_load((CHART / "values-gpu.yaml").read_text())["rollout"]
    return values


def render(values: dict) -> list[dict]:
    """The chart's objects for these values (hooks left out), without Helm's labels."""
    with helm_python.Chart.load(CHART) as chart:
        rendered = chart.render(copy.deepcopy(values), name=RELEASE, namespace=RELEASE, is_install=True)
    docs = [doc for path, text in sorted(rendered.items()) if path.endswith(".yaml")
            for doc in yaml.safe_load_all(text) if doc]
    docs = [d for d in docs if "helm.sh/hook" not in d["metadata"].get("annotations", {})]
    for doc in docs:
        labels = doc["metadata"].get("labels", {})
        for label in HELM_LABELS:
            labels.pop(label, None)
    return docs


def gpu_rollout_patch() -> dict:
    [rollout] = [d for d in render(gpu_rollout_values())
                 if d["kind"] == "Deployment" and d["metadata"]["name"] == f"{RELEASE}-rollout"]
    return rollout


def base_text() -> str:
    return HEADER + dump(render(base_values()))


def gpu_patch_text() -> str:
    note = ("# The rollout Deployment on GPUs (values-gpu.yaml's rollout values): a strategic-merge\n"
            "# patch of the base's, so containers, env and volumes merge by name.\n")
    return HEADER + note + dump([gpu_rollout_patch()])


def write() -> list[Path]:
    BASE_FILE.write_text(base_text())
    GPU_PATCH_FILE.write_text(gpu_patch_text())
    return [BASE_FILE, GPU_PATCH_FILE]


if __name__ == "__main__":
    for path in write():
        print(f"wrote {path.relative_to(REPO_ROOT)}")
