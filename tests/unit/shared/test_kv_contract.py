"""The KV policy names and the "vLLM keeps a dense cache" rule are defined once (shared.kv,
shared.agreement); every other spelling of them derives from those or is held to them here."""

from __future__ import annotations

import argparse
import json
from pathlib import Path
from typing import get_args

import jsonschema
import pytest
import yaml

from services.cli import build_parser
from services.rollout.api import GenerateRequest
from services.rollout.engine.config import KVConfig
from services.rollout.engine.policies import POLICIES
from services.rollout.settings import RolloutSettings
from shared.agreement import DENSE_ONLY_ENGINES, kv_policy_refusal, served_kv_policy
from shared.kv import DEFAULT_KV_BUDGET, DEFAULT_KV_BUFFER, KV_POLICIES, LAYER_BUDGETS, SPARSE_POLICIES
from tests.paths import REPO_ROOT

CHART = REPO_ROOT / "k8s" / "helm" / "sparsecast"


def _schema() -> dict:
    return json.loads((CHART / "values.schema.json").read_text())


def test_every_kv_policy_name_is_the_shared_tuple() -> None:
    assert KV_POLICIES == ("dense", "streaming", "snapkv", "h2o", "rkv")
    assert tuple(POLICIES) == KV_POLICIES  # the engine implements each name, and no other
    assert get_args(RolloutSettings.model_fields["kv_policy"].annotation) == KV_POLICIES
    assert get_args(KVConfig.model_fields["policy"].annotation) == KV_POLICIES
    request_type = GenerateRequest.model_fields["kv_policy"].annotation
    assert [a for a in get_args(request_type) if a is not type(None)] == [
        KVConfig.model_fields["policy"].annotation
    ]
    demo = next(a for a in build_parser()._actions if isinstance(a, argparse._SubParsersAction)).choices[
        "demo"
    ]
    assert next(a for a in demo._actions if a.dest == "kv_policy").choices == KV_POLICIES
    chart = _schema()["properties"]["rollout"]["properties"]
    assert tuple(chart["kvPolicy"]["enum"]) == KV_POLICIES


def test_every_layer_budget_name_is_the_shared_tuple() -> None:
    assert LAYER_BUDGETS == ("uniform", "pyramid")
    assert get_args(RolloutSettings.model_fields["kv_layer_budgets"].annotation) == LAYER_BUDGETS
    assert get_args(KVConfig.model_fields["layer_budgets"].annotation) == LAYER_BUDGETS
    chart = _schema()["properties"]["rollout"]["properties"]
    assert tuple(chart["kvLayerBudgets"]["enum"]) == LAYER_BUDGETS


def test_budget_defaults_are_the_shared_ones() -> None:
    settings = RolloutSettings()
    assert (settings.kv_budget, settings.kv_buffer) == (DEFAULT_KV_BUDGET, DEFAULT_KV_BUFFER) == (512, 128)
    assert (KVConfig().budget, KVConfig().buffer) == (512, 128)


@pytest.mark.parametrize("policy", SPARSE_POLICIES)
def test_dense_only_engines_refuse_sparse_policies_everywhere(policy: str) -> None:
    assert DENSE_ONLY_ENGINES == {"vllm"}
    assert served_kv_policy("vllm", policy) == "dense" and served_kv_policy("native", policy) == policy
    refusal = kv_policy_refusal("vllm", policy)
    assert refusal is not None and policy in refusal and "native engine" in refusal
    assert kv_policy_refusal("native", policy) is None and kv_policy_refusal("vllm", None) is None
    # The chart's schema states the same rule.
    values = yaml.safe_load((CHART / "values.yaml").read_text())
    values["rollout"].update(engine="vllm", kvPolicy=policy)
    assert list(jsonschema.Draft7Validator(_schema()).iter_errors(values))
    values["rollout"]["kvPolicy"] = "dense"
    assert not list(jsonschema.Draft7Validator(_schema()).iter_errors(values))


def _env(manifest: Path, name: str) -> str:
    for document in yaml.safe_load_all(manifest.read_text()):
        for container in document["spec"]["template"]["spec"]["containers"]:
            for entry in container.get("env", []):
                if entry["name"] == name:
                    return str(entry["value"])
    raise AssertionError(f"{name} not in {manifest.name}")


def test_deployment_kv_defaults_are_the_demo_and_sparse_rl_ones() -> None:
    from services.demo.options import DEMO_KV_BUDGET, DemoOptions

    root = REPO_ROOT
    assert DemoOptions().kv_budget == DEMO_KV_BUDGET == 32
    compose = yaml.safe_load((root / "compose.yaml").read_text())["services"]
    cpu_env = next(s["environment"] for s in compose.values()
                   if str(s.get("environment", {}).get("SPARSECAST_KV_BUDGET", "")).endswith(":-32}"))
    assert cpu_env["SPARSECAST_KV_BUDGET"] == f"${{SPARSECAST_KV_BUDGET:-{DEMO_KV_BUDGET}}}"
    gpu_budgets = [s["environment"]["SPARSECAST_KV_BUDGET"] for s in compose.values()
                   if "GPU_KV_BUDGET" in str(s.get("environment", {}).get("SPARSECAST_KV_BUDGET", ""))]
    assert gpu_budgets == [f"${{SPARSECAST_GPU_KV_BUDGET:-{DEFAULT_KV_BUDGET}}}"]
    assert yaml.safe_load((CHART / "values.yaml").read_text())["rollout"]["kvBudget"] == DEMO_KV_BUDGET
    gpu = yaml.safe_load((CHART / "values-gpu.yaml").read_text())["rollout"]
    assert (gpu["kvBudget"], gpu["kvBuffer"]) == (DEFAULT_KV_BUDGET, DEFAULT_KV_BUFFER)
    kustomize = root / "k8s" / "kustomize"
    assert _env(kustomize / "base" / "rollout.yaml", "SPARSECAST_KV_BUDGET") == str(DEMO_KV_BUDGET)
    overlay = kustomize / "overlays" / "gpu" / "rollout-gpu.yaml"
    assert _env(overlay, "SPARSECAST_KV_BUDGET") == str(DEFAULT_KV_BUDGET)
    assert _env(overlay, "SPARSECAST_KV_BUFFER") == str(DEFAULT_KV_BUFFER)
