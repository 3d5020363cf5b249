"""One set of demo defaults: `make demo` (services/demo/options.py) is the reference, and compose.yaml, the
Helm chart and the kustomize base start the same training (learning rate, batch shape, KV budget
semantics, run name)."""

from __future__ import annotations

import re

import yaml

from services.demo.options import RUN, DemoOptions
from shared.kv import DEMO_KV
from tests.paths import REPO_ROOT
from tests.unit.deploy.test_deploy_compose import load_compose
from tests.unit.deploy.test_deploy_k8s import (
    container_env,
    helm_template,
    kubectl_kustomize,
    sparsecast_containers,
)

ROOT = REPO_ROOT
TRAINER_KEYS = ("SPARSECAST_OPTIM__LR", "SPARSECAST_GROUPS_PER_STEP", "SPARSECAST_SAMPLES_PER_PROMPT")
ROLLOUT_KEYS = (
    "SPARSECAST_KV__POLICY",
    "SPARSECAST_KV__BUDGET",
    "SPARSECAST_KV__BUFFER",
    "SPARSECAST_KV__KEEP_PROMPT",
)


def demo_defaults() -> dict[str, object]:
    o = DemoOptions()
    return {
        "SPARSECAST_RUN": RUN,
        "SPARSECAST_OPTIM__LR": float(o.lr),
        "SPARSECAST_GROUPS_PER_STEP": o.groups_per_step,
        "SPARSECAST_SAMPLES_PER_PROMPT": o.samples_per_prompt,
        "SPARSECAST_KV__POLICY": o.kv_policy,
        # The demo's cache: `make demo` sizes its first budget per run from its KV floor (36 on its
        # task, DemoOptions.kv_budget None), which the deployments' trainers do not set; their
        # workers start at the cache's own 32 and the controller moves it from there.
        "SPARSECAST_KV__BUDGET": DEMO_KV.budget,
        "SPARSECAST_KV__BUFFER": o.kv_buffer,
        "SPARSECAST_KV__KEEP_PROMPT": o.kv_keep_prompt,
    }


def typed(key: str, text: str) -> object:
    """An environment value as the setting's type: "5e-5" and "5e-05" are one learning rate."""
    kind = type(demo_defaults()[key])
    if kind is bool:
        return text.strip().lower() in ("1", "true", "yes")
    return kind(text)


def compose_default(value: str) -> str:
    """`${VAR:-default}` → default (what a plain `docker compose up` uses)."""
    found = re.fullmatch(r"\$\{[A-Z_]+:-([^}]*)\}", str(value))
    return found.group(1) if found else str(value)


def settings_of(
    env_by_service: dict[str, dict[str, str | None]], config: dict[str, str]
) -> dict[str, object]:
    out: dict[str, object] = {"SPARSECAST_RUN": typed("SPARSECAST_RUN", config["SPARSECAST_RUN"])}
    for service, keys in (("trainer", TRAINER_KEYS), ("rollout", ROLLOUT_KEYS)):
        for key in keys:
            assert env_by_service[service].get(key) is not None, f"{service} does not set {key}"
            out[key] = typed(key, env_by_service[service][key])
    return out


def manifests_settings(docs: list[dict]) -> dict[str, object]:
    env = {name: container_env(container) for name, (_, container) in sparsecast_containers(docs).items()}
    [config] = [d for d in docs if d["kind"] == "ConfigMap" and "SPARSECAST_RUN" in d.get("data", {})]
    return settings_of(env, config["data"])


def test_compose_starts_the_demos_training() -> None:
    services = load_compose()["services"]
    env = {
        name: {k: compose_default(v) for k, v in services[name]["environment"].items()}
        for name in ("trainer", "rollout")
    }
    assert settings_of(env, env["trainer"]) == demo_defaults()


def test_helm_chart_starts_the_demos_training() -> None:
    assert manifests_settings(helm_template()) == demo_defaults()


def test_kustomize_starts_the_demos_training() -> None:
    assert manifests_settings(kubectl_kustomize("cpu")) == demo_defaults()


def test_compose_recomputes_as_the_demo_does() -> None:
    """The CPU profile is the demo's: replayed log-probs (services/demo/options.py); the GPU
    profile keeps the service default, whose masks scale to real models."""
    services = load_compose()["services"]
    env = {k: compose_default(v) for k, v in services["trainer"]["environment"].items()}
    assert env["SPARSECAST_LOSS__RECOMPUTE"] == DemoOptions().recompute
    assert "SPARSECAST_LOSS__RECOMPUTE" not in services["trainer-gpu"].get("environment", {})


def test_compose_moves_the_kv_budget_as_the_demo_does() -> None:
    """The CPU profile runs the trainer's KV budget controller, as `make demo` does by default."""
    services = load_compose()["services"]
    env = {k: compose_default(v) for k, v in services["trainer"]["environment"].items()}
    assert DemoOptions().kv_adaptive and env["SPARSECAST_KV_CONTROL__MODE"] == "adaptive"
    assert "SPARSECAST_KV_CONTROL__MODE" not in services["trainer-gpu"].get("environment", {})


def test_compose_submits_whole_demo_steps() -> None:
    command = load_compose()["services"]["demo-submit"]["command"]
    count = int(compose_default(command[command.index("--generate") + 1]))
    assert count == DemoOptions().steps * DemoOptions().groups_per_step


def test_a_differing_deploy_file_is_caught() -> None:
    # The comparison is real: the old chart learning rate differs from the demo's.
    values = yaml.safe_load((ROOT / "k8s/helm/sparsecast/values.yaml").read_text())
    changed = [
        e | {"value": "2e-5"} if e["name"] == "SPARSECAST_OPTIM__LR" else e
        for e in values["trainer"]["extraEnv"]
    ]
    assert manifests_settings(helm_template(overrides={"trainer": {"extraEnv": changed}})) != demo_defaults()
