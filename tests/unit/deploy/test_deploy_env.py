"""Every SPARSECAST_* name the deployment files set is a real setting of a service, none of them is a
deprecated flat alias of a nested setting (SPARSECAST_KV_BUDGET for SPARSECAST_KV__BUDGET), and every
one of them is listed in docs/deploy.md (the one list the services' settings and the deploy files
share)."""

from __future__ import annotations

import re
import shutil
import subprocess
from pathlib import Path

import pytest
import yaml
from pydantic import BaseModel

from services.registry.settings import RegistrySettings
from services.rollout.settings import RolloutSettings
from services.trainer.settings import TrainerSettings
from tests.paths import REPO_ROOT

ROOT = REPO_ROOT
NAME = re.compile(r"\bSPARSECAST_[A-Z0-9_]+\b")
SETTINGS = (RegistrySettings, RolloutSettings, TrainerSettings)
# Flat names a nested setting keeps as a deprecated alias for now (shared.settings.FlatAliases):
# the services still read them, our own deploy files must not set them.
DEPRECATED_ALIASES = {
    f"SPARSECAST_{flat.upper()}" for flat in (*RolloutSettings.flat_aliases, *TrainerSettings.flat_aliases)
}


def deploy_files() -> list[Path]:
    files = [ROOT / "compose.yaml", *sorted((ROOT / "docker").glob("Dockerfile.*"))]
    files += sorted((ROOT / "deploy" / "env").iterdir())
    files += sorted(p for p in (ROOT / "k8s").rglob("*") if p.is_file())
    return files


def container_env_names() -> set[str]:
    """Names that reach a container's environment (not compose's own ${...} variables)."""
    names: set[str] = set()
    compose = yaml.safe_load((ROOT / "compose.yaml").read_text())
    for service in compose["services"].values():
        names |= {k for k in service.get("environment", {}) if k.startswith("SPARSECAST_")}
    for path in (ROOT / "deploy" / "env").iterdir():
        names |= set(re.findall(r"^#?\s*(SPARSECAST_[A-Z0-9_]+)=", path.read_text(), re.MULTILINE))
    for dockerfile in (ROOT / "docker").glob("Dockerfile.*"):
        env_lines = re.findall(r"^ENV (.*?)(?=^\S)", dockerfile.read_text(), re.MULTILINE | re.DOTALL)
        names |= set(NAME.findall(" ".join(env_lines)))
    if shutil.which("kubectl"):
        for overlay in ("cpu", "gpu"):
            rendered = subprocess.run(
                ["kubectl", "kustomize", str(ROOT / "k8s" / "kustomize" / "overlays" / overlay)],
                capture_output=True, text=True, timeout=60, check=True,
            )
            names |= set(NAME.findall(rendered.stdout))
    chart = ROOT / "k8s" / "helm" / "sparsecast"
    for values_file in chart.glob("values*.yaml"):
        values = yaml.safe_load(values_file.read_text())
        for component in ("registry", "trainer", "rollout"):
            names |= {e["name"] for e in values.get(component, {}).get("extraEnv", [])}
    for template in (chart / "templates").glob("*.yaml"):
        names |= set(
            re.findall(r"^\s+(?:- name: )?(SPARSECAST_[A-Z0-9_]+)", template.read_text(), re.MULTILINE)
        )
    return names


def is_setting(name: str) -> bool:
    """A field of a service's settings; SECTION__FIELD a field of that section's model (a dict such
    as STORE_OPTIONS takes any key)."""
    return any(_is_field(settings, name.removeprefix("SPARSECAST_").lower().split("__"))
               for settings in SETTINGS)


def _is_field(model: type[BaseModel], parts: list[str]) -> bool:
    field = model.model_fields.get(parts[0])
    if field is None:
        return False
    if len(parts) == 1:
        return True
    section = field.annotation
    return not (isinstance(section, type) and issubclass(section, BaseModel)) or _is_field(section, parts[1:])


def test_container_env_names_are_service_settings() -> None:
    names = container_env_names()
    assert {"SPARSECAST_REDIS_URL", "SPARSECAST_PORT", "SPARSECAST_KV__POLICY",
            "SPARSECAST_OPTIM__LR"} <= names
    unknown = sorted(name for name in names if not is_setting(name))
    assert not unknown, f"set by the deploy files but read by no service: {unknown}"


def test_no_deploy_file_uses_a_deprecated_alias() -> None:
    """Not in a container's environment, nor as a compose variable or in a comment: the nested
    names only (a user's own local env file may still set an alias; the service warns)."""
    used = {
        f"{path.relative_to(ROOT)}: {name}"
        for path in deploy_files()
        for name in NAME.findall(path.read_text())
        if name in DEPRECATED_ALIASES
    }
    assert not used, f"deprecated flat names in the deploy files: {sorted(used)}"


def test_every_name_is_documented_in_deploy_md() -> None:
    documented = set(NAME.findall((ROOT / "docs" / "deploy.md").read_text()))
    used = {name for path in deploy_files() for name in NAME.findall(path.read_text())}
    assert not sorted(used - documented), f"missing from docs/deploy.md: {sorted(used - documented)}"


@pytest.mark.parametrize("name", ["SPARSECAST_KV__BUDGET", "SPARSECAST_OPTIM__LR", "SPARSECAST_STORE_URL",
                                  "SPARSECAST_MODEL"])
def test_is_setting_tells_real_from_made_up(name: str) -> None:
    assert is_setting(name)
    assert not is_setting(name + "_TYPO")


@pytest.mark.parametrize("name", ["SPARSECAST_KV_BUDGET", "SPARSECAST_KV_LAYER_BUDGETS", "SPARSECAST_LR",
                                  "SPARSECAST_GRAD_CLIP"])
def test_deprecated_aliases_are_not_settings_here(name: str) -> None:
    # The aliases still work in a service (FlatAliases) but are no settings the deploy files may set.
    assert name in DEPRECATED_ALIASES
    assert not is_setting(name)
