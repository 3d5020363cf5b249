"""The KV policy names and the "vLLM keeps a dense cache" rule are defined once (shared.kv,
shared.agreement); every other spelling of them derives from those or is held to them here."""

from __future__ import annotations

import argparse
import inspect
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
from shared.kv import (
    DEFAULT_KV_BUDGET,
    DEFAULT_KV_BUFFER,
    KV_POLICIES,
    LAYER_BUDGETS,
    SPARSE_POLICIES,
    KVSettings,
)
from tests.paths import REPO_ROOT

CHART = REPO_ROOT / "k8s" / "helm" / "sparsecast"


def _schema() -> dict:
    return json.loads((CHART / "values.schema.json").read_text())


def test_every_kv_policy_name_is_the_shared_tuple() -> None:
    assert KV_POLICIES == ("dense", "streaming", "snapkv", "h2o", "rkv")
    assert tuple(POLICIES) == KV_POLICIES  # the engine implements each name, and no other
    assert RolloutSettings.model_fields["kv"].annotation is KVSettings
    assert get_args(KVSettings.model_fields["policy"].annotation) == KV_POLICIES
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
    assert get_args(KVSettings.model_fields["layer_budgets"].annotation) == LAYER_BUDGETS
    assert get_args(KVConfig.model_fields["layer_budgets"].annotation) == LAYER_BUDGETS
    chart = _schema()["properties"]["rollout"]["properties"]
    assert tuple(chart["kvLayerBudgets"]["enum"]) == LAYER_BUDGETS


def test_budget_defaults_are_the_shared_ones() -> None:
    # One default each, the section's: the worker's settings and the engine's KVConfig take it.
    assert (KVSettings().budget, KVSettings().buffer) == (DEFAULT_KV_BUDGET, DEFAULT_KV_BUFFER) == (512, 128)
    assert RolloutSettings().kv == KVSettings()
    section = set(KVSettings.model_fields)
    assert KVConfig().model_dump(include=section) == KVSettings().model_dump() | {"policy": "dense"}
    # KVConfig redeclares none of the section's fields but the policy (an engine call that names
    # none keeps a dense cache).
    assert set(inspect.get_annotations(KVConfig)) & section == {"policy"}


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
    """The value of env var `name` in the first workload of `manifest` that sets it."""
    for document in yaml.safe_load_all(manifest.read_text()):
        if not document or "template" not in document.get("spec", {}):
            continue  # not a workload (ConfigMap, Service, NetworkPolicy, ...)
        for container in document["spec"]["template"]["spec"]["containers"]:
            for entry in container.get("env", []):
                if entry["name"] == name:
                    return str(entry["value"])
    raise AssertionError(f"{name} not in {manifest.name}")


def test_deployment_kv_defaults_are_the_demo_and_sparse_rl_ones() -> None:
    # The CPU deploy files and the demo take the demo's cache (shared.kv.DEMO_KV), the GPU ones the
    # section's defaults (Sparse-RL's), under the section's names SPARSECAST_KV__* (the flat
    # SPARSECAST_KV_* aliases are refused in the deploy files: tests/unit/deploy/test_deploy_env.py).
    from services.demo.options import DemoOptions
    from services.trainer.warmstart_recipe import DEMO_CACHE
    from shared.kv import DEMO_KV, DEMO_KV_BUDGET, DEMO_KV_BUFFER, DEMO_KV_POLICY

    root = REPO_ROOT
    demo = DemoOptions()
    assert (demo.kv_policy, demo.kv_buffer, demo.kv_keep_prompt) == (
        DEMO_KV.policy, DEMO_KV.buffer, DEMO_KV.keep_prompt) == ("rkv", 2, True)
    assert DEMO_KV.budget == 32 and demo.kv_budget is None  # the demo's first budget is sized per run
    # The flat names the warm start's recipe reads: the demo's cache, with the prompt evictable there.
    assert (DEMO_KV_POLICY, DEMO_KV_BUDGET, DEMO_KV_BUFFER) == (
        DEMO_KV.policy, DEMO_KV.budget, DEMO_KV.buffer)
    assert DEMO_CACHE == {"policy": "rkv", "budget": 32, "buffer": 2, "keep_prompt": False}
    flags = {True: "true", False: "false"}
    compose = yaml.safe_load((root / "compose.yaml").read_text())["services"]
    cpu_env = next(s["environment"] for s in compose.values()
                   if str(s.get("environment", {}).get("SPARSECAST_KV__BUDGET", "")).endswith(":-32}"))
    assert cpu_env["SPARSECAST_KV__POLICY"] == f"${{SPARSECAST_KV__POLICY:-{DEMO_KV.policy}}}"
    assert cpu_env["SPARSECAST_KV__BUDGET"] == f"${{SPARSECAST_KV__BUDGET:-{DEMO_KV.budget}}}"
    assert cpu_env["SPARSECAST_KV__BUFFER"] == f"${{SPARSECAST_KV__BUFFER:-{DEMO_KV.buffer}}}"
    assert cpu_env["SPARSECAST_KV__KEEP_PROMPT"] == flags[DEMO_KV.keep_prompt]
    gpu_budgets = [s["environment"]["SPARSECAST_KV__BUDGET"] for s in compose.values()
                   if "GPU_KV_BUDGET" in str(s.get("environment", {}).get("SPARSECAST_KV__BUDGET", ""))]
    assert gpu_budgets == [f"${{SPARSECAST_GPU_KV_BUDGET:-{DEFAULT_KV_BUDGET}}}"]
    chart = yaml.safe_load((CHART / "values.yaml").read_text())["rollout"]
    assert (chart["kvPolicy"], chart["kvBudget"], chart["kvBuffer"], chart["kvKeepPrompt"]) == (
        DEMO_KV.policy, DEMO_KV.budget, DEMO_KV.buffer, DEMO_KV.keep_prompt)
    gpu = yaml.safe_load((CHART / "values-gpu.yaml").read_text())["rollout"]
    assert (gpu["kvBudget"], gpu["kvBuffer"]) == (DEFAULT_KV_BUDGET, DEFAULT_KV_BUFFER)
    kustomize = root / "k8s" / "kustomize"
    # The base is generated from the chart (make kustomize-base) into one file.
    base = kustomize / "base" / "sparsecast.yaml"
    names = ("POLICY", "BUDGET", "BUFFER", "KEEP_PROMPT")
    assert [_env(base, f"SPARSECAST_KV__{name}") for name in names] == [
        DEMO_KV.policy, str(DEMO_KV.budget), str(DEMO_KV.buffer), flags[DEMO_KV.keep_prompt]]
    overlay = kustomize / "overlays" / "gpu" / "rollout-gpu.yaml"
    assert _env(overlay, "SPARSECAST_KV__BUDGET") == str(DEFAULT_KV_BUDGET)
    assert _env(overlay, "SPARSECAST_KV__BUFFER") == str(DEFAULT_KV_BUFFER)
