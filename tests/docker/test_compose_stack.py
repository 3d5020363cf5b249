"""The user's compose.yaml, for real, driven by the README's own compose commands and the REST
examples of docs/api.md (parsed from them: tests/doc_snippets.py): images built by `docker compose
build`, the README's `up`, training that publishes versions every worker loads, a trainer restart
that resumes, the REST examples answering 2xx, the README's `--scale` and `down -v`. Stand-ins for
unreachable third-party images: tests/docker/compose.ci.yaml."""

from __future__ import annotations

import json
import re
import subprocess
import tempfile
import time
from pathlib import Path

import httpx
import pytest

from tests.doc_snippets import compose_commands, rest_script, run_shell, write_uploads
from tests.docker.conftest import ComposeProject

pytestmark = pytest.mark.docker

TOKEN_FILE = "deploy/env/sparsecast.env"
MIN_VERSIONS = 5
WEIGHTS = (
    "import json, urllib.request; "
    "print(json.load(urllib.request.urlopen('http://127.0.0.1:8200/v1/weights'))['version'])"
)


def wait_for(what: str, check, timeout: float, project: ComposeProject, every: float = 3.0):
    deadline = time.monotonic() + timeout
    last = None
    while time.monotonic() < deadline:
        try:
            last = check()
        except (httpx.HTTPError, AssertionError, ValueError, KeyError) as exc:
            last = exc
        else:
            if last:
                return last
        time.sleep(every)
    raise AssertionError(f"timed out waiting for {what} (last: {last!r})\n{project.logs()[-6000:]}")


def trainer_status(url: str) -> dict:
    return httpx.get(f"{url}/v1/status", timeout=10).json()


def worker_versions(project: ComposeProject) -> list[int]:
    """Each rollout replica's loaded weight version, asked inside its own container."""
    versions = []
    for index in range(1, len(project.containers("rollout")) + 1):
        out = project.run("exec", "-T", "--index", str(index), "rollout", "python", "-c", WEIGHTS, timeout=60)
        versions.append(int(out.stdout.strip()))
    return versions


def registry_head(url: str) -> int:
    return httpx.get(f"{url}/v1/runs/demo/latest", timeout=10).json()["version"]


def workers_at_head(project: ComposeProject, registry: str, count: int) -> bool:
    head = registry_head(registry)
    versions = worker_versions(project)
    return len(versions) == count and all(v == head for v in versions) and head >= MIN_VERSIONS


def readme_command(*words: str) -> list[str]:
    """The README's `docker compose WORDS` command, or the one command that starts with WORDS."""
    commands = compose_commands()
    if list(words) in commands:
        return list(words)
    [command] = [c for c in commands if c[: len(words)] == list(words)]
    return command


def test_compose_up_trains_resumes_and_scales(compose_stack: ComposeProject) -> None:
    project = compose_stack
    started = time.monotonic()
    # The README's `up -d` returns once every container started, i.e. after the trainer's
    # healthcheck passed; its `ps` then shows the trainer healthy.
    project.run(*readme_command("up", "-d"), timeout=1800)
    ps = project.run(*readme_command("ps")).stdout
    assert re.search(r"trainer.*\(healthy\)", ps), ps
    trainer = f"http://127.0.0.1:{project.port('trainer', 8000)}"
    registry = f"http://127.0.0.1:{project.port('registry', 8100)}"

    # demo-submit enqueues the built-in task's prompts once the trainer is ready.
    status = wait_for(
        f"{MIN_VERSIONS} published versions",
        lambda: (s := trainer_status(trainer))["version"] is not None and s["version"] >= MIN_VERSIONS and s,
        1500,
        project,
        every=5,
    )
    assert status["run"] == "demo" and status["error"] is None, status
    # Each version is a sparse patch, far smaller than the dense weights (payload_ratio = dense / patch).
    versions = httpx.get(f"{trainer}/v1/versions", timeout=10).json()["versions"]
    ratios = [v["payload_ratio"] for v in versions if v["version"] > 0]
    assert len(ratios) >= MIN_VERSIONS and min(ratios) > 4, ratios
    wait_for("the worker at the registry's head", lambda: workers_at_head(project, registry, 1), 300, project)
    print(f"trained to v{status['version']} in {time.monotonic() - started:.0f} s after `up`")

    # A restarted trainer resumes from its checkpoint volume: never back at v0, and it goes on.
    before = trainer_status(trainer)["version"]
    project.run("restart", "trainer", timeout=300)
    trainer = f"http://127.0.0.1:{project.port('trainer', 8000)}"  # a restart draws a new host port
    resumed = wait_for(
        "the restarted trainer",
        lambda: (s := trainer_status(trainer))["version"] is not None and s["state"] != "starting" and s,
        900,
        project,
    )
    assert resumed["version"] >= before, (before, resumed)
    more = httpx.post(
        f"{trainer}/v1/prompts",
        json={"task": "addition", "generate": {"count": 16}},
        headers={"Authorization": f"Bearer {demo_token()}"},
        timeout=30,
    )
    assert more.status_code < 300, more.text
    wait_for(
        "a version after the restart",
        lambda: trainer_status(trainer)["version"] > resumed["version"],
        900,
        project,
        every=5,
    )

    # docs/api.md's REST examples against the published ports, with the env file's token (its
    # worker lines need a worker you run yourself: compose publishes none, as the docs say).
    folder = Path(tempfile.mkdtemp(prefix="sparsecast-readme-"))
    write_uploads(folder)
    urls = {"http://127.0.0.1:8000": trainer, "http://127.0.0.1:8100": registry}
    script = rest_script("TR")
    done = run_shell(script, urls, {"SPARSECAST_API_TOKEN": demo_token()}, folder)
    assert done.returncode == 0, f"{script}\n{done.stdout[-3000:]}\n{done.stderr[-3000:]}"

    # The README's `--scale`: the new workers catch up from the registry and serve the head too.
    scale = readme_command("up", "-d", "--scale")
    workers_wanted = int(next(a for a in scale if a.startswith("rollout=")).split("=")[1])
    project.run(*scale, timeout=600)
    assert len(project.containers("rollout")) == workers_wanted
    wait_for("every worker at the head", lambda: workers_at_head(project, registry, workers_wanted), 900,
             project)
    workers = trainer_status(trainer)["workers"]
    assert len(workers) >= workers_wanted, json.dumps(workers)

    project.run(*readme_command("down", "-v"), timeout=300)
    assert project.containers("trainer") == []
    left = subprocess.run(
        ["docker", "volume", "ls", "-q", "--filter", f"label=com.docker.compose.project={project.name}"],
        capture_output=True,
        text=True,
        timeout=60,
    )
    assert left.returncode == 0 and left.stdout.strip() == "", left.stdout
    print(f"compose stack test: {time.monotonic() - started:.0f} s after `up`")


def demo_token() -> str:
    from tests.docker.conftest import ROOT

    for line in (ROOT / TOKEN_FILE).read_text().splitlines():
        if line.startswith("SPARSECAST_API_TOKEN="):
            return line.split("=", 1)[1]
    raise AssertionError(f"no token in {TOKEN_FILE}")
