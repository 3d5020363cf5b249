"""Every fenced `sparsecast …` command of README.md and docs/, and the REST examples (docs/api.md), run
as written against a live stack: registry, trainer and one rollout worker over real HTTP with real
Redis, run `demo` (the services' default), the token in SPARSECAST_API_TOKEN.

Only what names another host changes: the docs' in-cluster addresses (`http://trainer:8000`,
`http://registry:8100`) and compose's published ports become the test stack's loopback ports.
Commands that need a CUDA device are parsed by the CLI instead of run.
"""

from __future__ import annotations

import os
import re
import shlex
import subprocess
import sys
import time
from collections.abc import Iterator
from pathlib import Path

import httpx
import pytest
import redis

from services.cli import build_parser, list_benches, parse_args
from services.registry.app import create_app as create_registry
from services.registry.settings import RegistrySettings
from services.rollout.app import create_app as create_rollout
from services.rollout.settings import RolloutSettings, SyncSettings
from services.trainer.app import create_app as create_trainer
from services.trainer.optim import OptimSettings
from services.trainer.settings import TrainerSettings
from shared.coord import CoordSettings
from shared.kv import KVSettings
from tests.conftest import REDIS_URL, serve_app
from tests.doc_snippets import commands_starting, rest_script, run_shell, strip_comment, write_uploads
from tests.paths import REPO_ROOT

TOKEN = "doc-commands-token"
RUN = "demo"  # the run the docs name: the services' default and compose's
GPU_ONLY = "--device cuda"


@pytest.fixture(scope="module")
def stack(tiny_model_dir: str, tmp_path_factory: pytest.TempPathFactory) -> Iterator[dict[str, str]]:
    tmp = tmp_path_factory.mktemp("doc-stack")
    prefix = f"test:{os.urandom(6).hex()}"
    coord = CoordSettings(lease_ttl_s=60, base_claim=2, max_claim=2, staleness_bound=1, max_lag=2)
    registry = RegistrySettings(store_url=f"file://{tmp / 'store'}", api_token=TOKEN, run=RUN,
                                redis_url=REDIS_URL, redis_prefix=prefix)
    with serve_app(create_registry(registry)) as registry_url:
        trainer = TrainerSettings(
            model=tiny_model_dir, device="cpu", data_dir=str(tmp / "trainer"), run=RUN, api_token=TOKEN,
            registry_url=registry_url, redis_url=REDIS_URL, redis_prefix=prefix, coord=coord,
            groups_per_step=2, micro_batch=32, ppo_updates=1, checkpoint_every=0,
            optim=OptimSettings(lr=1e-4),
        )
        with serve_app(create_trainer(trainer)) as trainer_url:
            deadline = time.monotonic() + 120
            while httpx.get(f"{trainer_url}/readyz").status_code != 200:
                assert time.monotonic() < deadline, "trainer not ready"
                time.sleep(0.2)
            worker = RolloutSettings(
                model="", registry_url=registry_url, run=RUN, device="cpu", redis_url=REDIS_URL,
                redis_prefix=prefix, worker_id="w-docs", kv=KVSettings(policy="rkv", budget=32, buffer=2),
                data_dir=str(tmp / "worker"), sync=SyncSettings(poll_s=0.2), coord=coord, api_token=TOKEN,
                # Short answers keep 9 steps of the random tiny model to seconds.
                max_new_tokens=16,
            )
            with serve_app(create_rollout(worker)) as worker_url:
                deadline = time.monotonic() + 120
                while httpx.get(f"{worker_url}/readyz").status_code != 200:
                    assert time.monotonic() < deadline, "worker not ready"
                    time.sleep(0.2)
                yield {"trainer": trainer_url, "registry": registry_url, "worker": worker_url}
    client = redis.Redis.from_url(REDIS_URL)
    keys = list(client.scan_iter(match=f"{prefix}*", count=1000))
    if keys:
        client.delete(*keys)
    client.close()


@pytest.fixture(scope="module")
def workdir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """The folder the examples run in, with the files they upload."""
    folder = tmp_path_factory.mktemp("doc-cwd")
    write_uploads(folder)
    return folder


def shell(script: str, stack: dict[str, str], cwd: Path) -> subprocess.CompletedProcess[str]:
    urls = {
        "http://trainer:8000": stack["trainer"], "http://registry:8100": stack["registry"],
        "http://127.0.0.1:8000": stack["trainer"], "http://127.0.0.1:8100": stack["registry"],
        "http://127.0.0.1:8201": stack["worker"],
    }
    env = {"SPARSECAST_API_TOKEN": TOKEN, "SPARSECAST_TRAINER_URL": stack["trainer"],
           "SPARSECAST_REGISTRY_URL": ""}
    return run_shell(script, urls, env, cwd, timeout=900)


SPARSECAST_COMMANDS = commands_starting("sparsecast")


def test_the_docs_show_sparsecast_commands() -> None:
    places = {where.split(":")[0] for where, _ in SPARSECAST_COMMANDS}
    assert {"docs/cli.md", "docs/training.md"} <= places, places
    assert any("--answer" in c and c.count("--answer") == 2 for _, c in SPARSECAST_COMMANDS)


@pytest.mark.parametrize(("where", "command"), SPARSECAST_COMMANDS, ids=[w for w, _ in SPARSECAST_COMMANDS])
def test_doc_command_runs(where: str, command: str, stack: dict[str, str], workdir: Path) -> None:
    if GPU_ONLY in command:
        # Needs a CUDA device: the CLI must accept it as written (placeholders filled in).
        argv = shlex.split(re.sub(r"<[^>]+>", "PLACEHOLDER", strip_comment(command)))[1:]
        args = parse_args(build_parser(), argv)
        if args.command == "bench":
            assert args.name in list_benches(), f"{where}: no benchmark {args.name!r}"
            help_text = subprocess.run([sys.executable, "-m", f"bench.{args.name}", "--help"], cwd=REPO_ROOT,
                                       capture_output=True, text=True, timeout=120)
            assert help_text.returncode == 0, help_text.stderr
            for option in (a for a in args.bench_args if a.startswith("--")):
                assert option in help_text.stdout, f"{where}: bench.{args.name} has no {option}"
        return
    done = shell(command, stack, workdir)
    assert done.returncode == 0, f"{where}: {command}\n{done.stdout[-2000:]}\n{done.stderr[-2000:]}"
    if command.startswith("sparsecast submit"):
        assert "queued" in done.stdout, done.stdout


def test_cli_submit_pairs_each_prompt_with_its_answer(stack: dict[str, str]) -> None:
    """The interleaved form (docs/cli.md) sends prompt i with answer i; a stray option is still an error."""
    args = parse_args(build_parser(), ["submit", "a\\n", "--answer", "1", "b\\n", "--answer", "2", "c\\n",
                                       "--answer", "3"])
    assert args.prompts == ["a\\n", "b\\n", "c\\n"] and args.answer == ["1", "2", "3"]
    with pytest.raises(SystemExit) as bad:
        parse_args(build_parser(), ["submit", "a", "--answer", "1", "b", "--bogus"])
    assert bad.value.code == 2
    with pytest.raises(SystemExit):
        parse_args(build_parser(), ["status", "stray"])


def test_readme_rest_examples_answer_2xx(stack: dict[str, str], workdir: Path) -> None:
    script = rest_script()
    done = shell(script, stack, workdir)
    assert done.returncode == 0, f"{script}\n{done.stdout[-2000:]}\n{done.stderr[-3000:]}"
    assert httpx.get(f"{stack['trainer']}/v1/status").json()["version"] >= 9
    assert '"fingerprint"' in done.stdout
