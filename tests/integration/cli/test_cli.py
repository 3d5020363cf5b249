"""The `sparsecast` CLI against a real trainer and registry (uvicorn on loopback, real Redis)."""

from __future__ import annotations

import asyncio
import io
import json
import subprocess
import sys
import time
import uuid
from collections.abc import Iterator
from pathlib import Path

import pytest
import redis
import redis.asyncio as aioredis

from services.cli import REPO_ROOT, main
from services.registry.app import create_app as create_registry
from services.registry.settings import RegistrySettings
from services.trainer.app import create_app as create_trainer
from services.trainer.settings import TrainerSettings
from shared.coord import Coordinator
from shared.patch import extract_patch
from shared.ports import free_port
from shared.registry.client import RegistryClient
from shared.schemas import WorkerInfo
from tests.conftest import REDIS_URL, serve_app

TOKEN = "cli-test-token"
RUN = "cli-test"


def _seed_versions(registry_url: str, trainer_state: dict) -> None:
    """Publish v1 and v2 as real sparse patches of the trainer's v0 weights."""
    state = {k: v.clone() for k, v in trainer_state["trainer"].learner.full_published().items()}

    async def publish() -> None:
        async with RegistryClient(registry_url, RUN, token=TOKEN) as client:
            for version in (1, 2):
                new = {k: v.clone() for k, v in state.items()}
                first = next(iter(sorted(new)))
                new[first].view(-1)[: 10 * version] += 1
                patch = extract_patch(state, new, run=RUN, base_version=version - 1, target_version=version)
                await client.publish_patch(version, patch, metrics={
                    "changed_fraction": 10 * version / sum(t.numel() for t in new.values()),
                    "reward_mean": 0.25 * version, "accuracy": 0.1 * version})
                state.update(new)

    asyncio.run(publish())


async def _register_worker(prefix: str) -> None:
    client = aioredis.Redis.from_url(REDIS_URL)
    try:
        await Coordinator(client, prefix, run=RUN).register_worker(WorkerInfo(
            worker_id="w-cli", engine="native", kv_policy="rkv", kv_budget=32, weight_version=1,
            tokens_per_s=321.0, leases=2, url="http://127.0.0.1:1"))
    finally:
        await client.aclose()


@pytest.fixture(scope="module")
def stack(tiny_model_dir: str, tmp_path_factory: pytest.TempPathFactory) -> Iterator[dict[str, str]]:
    prefix = f"test:{uuid.uuid4().hex[:12]}"
    registry_app = create_registry(RegistrySettings(store_url="memory://", api_token=TOKEN))
    with serve_app(registry_app) as registry_url:
        settings = TrainerSettings(
            model=tiny_model_dir,
            data_dir=str(tmp_path_factory.mktemp("trainer")),
            run=RUN,
            api_token=TOKEN,
            registry_url=registry_url,
            redis_url=REDIS_URL,
            redis_prefix=prefix,
            device="cpu",
            checkpoint_every=0,
        )
        trainer_app = create_trainer(settings)
        with serve_app(trainer_app) as trainer_url:
            state = trainer_app.state.trainer
            deadline = time.monotonic() + 60
            while state["trainer"] is None or state["trainer"].state == "starting":
                assert state["error"] is None, state["error"]
                assert time.monotonic() < deadline, "trainer did not boot"
                time.sleep(0.1)
            _seed_versions(registry_url, state)
            asyncio.run(_register_worker(prefix))
            yield {"trainer": trainer_url, "registry": registry_url}
    client = redis.Redis.from_url(REDIS_URL)
    keys = list(client.scan_iter(match=f"{prefix}*", count=1000))
    if keys:
        client.delete(*keys)
    client.close()


def run_cli(capsys: pytest.CaptureFixture, *argv: str) -> tuple[int, str, str]:
    capsys.readouterr()
    code = main(list(argv))
    out, err = capsys.readouterr()
    return code, out, err


def cli_json(capsys: pytest.CaptureFixture, *argv: str) -> dict | list:
    code, out, err = run_cli(capsys, *argv, "--json")
    assert code == 0, err
    return json.loads(out)


def test_status_reports_run_version_queue_and_workers(
    stack: dict[str, str], capsys: pytest.CaptureFixture
) -> None:
    status = cli_json(capsys, "status", "--trainer-url", stack["trainer"])
    assert status["run"] == RUN and status["version"] == 0 and status["state"] in ("collecting", "running")
    assert [w["worker_id"] for w in status["workers"]] == ["w-cli"]
    code, out, _ = run_cli(capsys, "status", "--trainer-url", stack["trainer"])
    assert code == 0
    assert f"run {RUN}" in out and "w-cli" in out and "rkv@32" in out


def test_versions_from_trainer_and_from_registry_agree(
    stack: dict[str, str], capsys: pytest.CaptureFixture
) -> None:
    via_trainer = cli_json(capsys, "versions", "--trainer-url", stack["trainer"])
    via_registry = cli_json(capsys, "versions", "--registry-url", stack["registry"], "--run", RUN)
    assert via_trainer["run"] == via_registry["run"] == RUN
    assert [v["version"] for v in via_trainer["versions"]] == [0, 1, 2]
    for a, b in zip(via_trainer["versions"], via_registry["versions"], strict=True):
        for key in (
            "version",
            "patch_bytes",
            "snapshot_bytes",
            "dense_bytes",
            "payload_ratio",
            "changed_fraction",
        ):
            assert a[key] == b[key], key
    v2 = via_registry["versions"][2]
    assert v2["base_version"] == 1 and 0 < v2["patch_bytes"] < v2["dense_bytes"]
    assert v2["payload_ratio"] == pytest.approx(v2["dense_bytes"] / v2["patch_bytes"])
    code, out, _ = run_cli(capsys, "versions", "--trainer-url", stack["trainer"])
    assert code == 0 and "v2" in out and "2 patches" in out and "less)" in out


def test_workers_lists_version_lag_leases_and_speed(
    stack: dict[str, str], capsys: pytest.CaptureFixture
) -> None:
    (worker,) = cli_json(capsys, "workers", "--trainer-url", stack["trainer"])
    assert worker["worker_id"] == "w-cli" and worker["weight_version"] == 1 and worker["leases"] == 2
    code, out, _ = run_cli(capsys, "workers", "--trainer-url", stack["trainer"])
    assert code == 0 and "w-cli" in out and "321" in out


def test_submit_from_arguments_jsonl_and_generator(stack: dict[str, str], capsys: pytest.CaptureFixture,
                                                   tmp_path: Path) -> None:
    url = ["--trainer-url", stack["trainer"], "--token", TOKEN]
    before = cli_json(capsys, "status", *url)["queue"]["prompts_queued"]
    got = cli_json(capsys, "submit", *url, "--task", "addition", "--samples", "3",
                   "add 12+34\\n", "add 5+6\\n", "--answer", "46", "--answer", "11")
    assert got["count"] == 2 and got["task"] == "addition" and got["samples_per_prompt"] == 3
    jsonl = tmp_path / "prompts.jsonl"
    jsonl.write_text(
        '{"prompt": "add 1+2\\n", "answer": "3"}\n\n{"question": "What is 2+2?", "answer": "so #### 4"}\n'
    )
    assert cli_json(capsys, "submit", *url, "--file", str(jsonl), "--samples", "2")["count"] == 2
    code, out, _ = run_cli(capsys, "submit", *url, "--generate", "5", "--seed", "7")
    assert code == 0 and "queued 5 prompt groups" in out
    assert cli_json(capsys, "status", *url)["queue"]["prompts_queued"] == before + 9


def test_exit_codes(stack: dict[str, str], capsys: pytest.CaptureFixture, tmp_path: Path) -> None:
    url = ["--trainer-url", stack["trainer"]]
    # API errors: wrong token, unknown task, a service that is not there → 1 with the reason.
    code, _, err = run_cli(capsys, "submit", *url, "--token", "wrong", "--generate", "1")
    assert code == 1 and "401" in err and "token" in err
    code, _, err = run_cli(
        capsys, "submit", *url, "--token", TOKEN, "--task", "no-such-task", "--generate", "1"
    )
    assert code == 1 and "400" in err and "no-such-task" in err
    code, _, err = run_cli(
        capsys, "status", "--trainer-url", f"http://127.0.0.1:{free_port()}", "--timeout", "2"
    )
    assert code == 1 and "cannot reach the trainer" in err
    # Usage errors → 2, before any request is made.
    bad_jsonl = tmp_path / "bad.jsonl"
    bad_jsonl.write_text('{"prompt": "x"}\nnot json\n')
    for argv in (
        ["submit", *url],
        ["submit", *url, "a", "b", "--answer", "1"],
        ["submit", *url, "--file", str(bad_jsonl)],
        ["submit", *url, "--file", str(tmp_path / "missing.jsonl")],
        ["submit", *url, "x", "--generate", "2"],
        ["no-such-command"],
        ["demo", "--steps", "0"],
        ["bench", "no-such-bench"],
        [],
    ):
        code, _, err = run_cli(capsys, *argv)
        assert code == 2, (argv, err)
        assert "usage" in err.lower() or "error" in err.lower()
    code, out, _ = run_cli(capsys, "--help")
    assert code == 0 and all(
        name in out for name in ("demo", "submit", "status", "versions", "workers", "bench")
    )


def test_help_of_each_command_and_bench_listing(capsys: pytest.CaptureFixture) -> None:
    for command, needle in (
        ("demo", "--keep-running"),
        ("submit", "--generate"),
        ("versions", "--registry-url"),
        ("status", "--trainer-url"),
        ("workers", "--json"),
        ("bench", "bench/results"),
    ):
        code, out, _ = run_cli(capsys, command, "--help")
        assert code == 0 and needle in out, command
    listed = cli_json(capsys, "bench")
    assert isinstance(listed, list)
    assert sorted(listed) == sorted(
        p.stem for p in (REPO_ROOT / "bench").glob("*.py") if not p.stem.startswith("_")
    )


def test_runs_as_a_module_with_exit_codes() -> None:
    ok = subprocess.run(
        [sys.executable, "-m", "services.cli", "status", "--help"], capture_output=True, text=True
    )
    assert ok.returncode == 0 and "sparsecast status" in ok.stdout
    usage = subprocess.run(
        [sys.executable, "-m", "services.cli", "status", "--bogus"], capture_output=True, text=True
    )
    assert usage.returncode == 2 and "unrecognized arguments" in usage.stderr


def test_pause_resume_checkpoint_and_tasks(stack: dict[str, str], capsys: pytest.CaptureFixture) -> None:
    url = ("--trainer-url", stack["trainer"], "--token", TOKEN)
    assert cli_json(capsys, "pause", *url)["paused"] is True
    assert cli_json(capsys, "status", *url)["paused"] is True
    code, out, _ = run_cli(capsys, "resume", *url)
    assert code == 0 and "resumed" in out
    assert cli_json(capsys, "status", *url)["paused"] is False
    saved = cli_json(capsys, "checkpoint", *url)
    assert Path(saved["path"]).exists()
    tasks = cli_json(capsys, "tasks", "--trainer-url", stack["trainer"])
    assert "addition" in tasks["tasks"]
    code, out, _ = run_cli(capsys, "tasks", "--trainer-url", stack["trainer"])
    assert code == 0 and f"{tasks['default']} (default)" in out


def test_a_401_says_where_the_token_comes_from(stack: dict[str, str], capsys: pytest.CaptureFixture,
                                               monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.delenv("SPARSECAST_API_TOKEN", raising=False)
    code, _, err = run_cli(capsys, "pause", "--trainer-url", stack["trainer"])
    text = " ".join(err.split())
    assert code == 1 and "401" in text and "no token was sent" in text
    assert "SPARSECAST_API_TOKEN" in text and "deploy/env/sparsecast.env" in text
    assert "kubectl get secret" in text
    code, _, err = run_cli(capsys, "pause", "--trainer-url", stack["trainer"], "--token", "wrong")
    assert code == 1 and "the token was refused" in " ".join(err.split())


def test_version_flag(capsys: pytest.CaptureFixture) -> None:
    import importlib.metadata

    code, out, _ = run_cli(capsys, "--version")
    assert code == 0 and out.strip() == f"sparsecast {importlib.metadata.version('sparsecast')}"


def test_one_default_run_name_everywhere(monkeypatch: pytest.MonkeyPatch) -> None:
    from services.cli import build_parser
    from services.demo.options import RUN as DEMO_RUN
    from services.registry.settings import RegistrySettings as Registry
    from services.rollout.settings import RolloutSettings
    from shared.schemas import DEFAULT_RUN

    monkeypatch.delenv("SPARSECAST_RUN", raising=False)
    assert build_parser().parse_args(["versions"]).run == DEFAULT_RUN == DEMO_RUN
    assert Registry().run == RolloutSettings().run == TrainerSettings().run == DEFAULT_RUN
    compose = (REPO_ROOT / "compose.yaml").read_text()
    assert f"SPARSECAST_RUN: ${{SPARSECAST_RUN:-{DEFAULT_RUN}}}" in compose


def test_tables_fit_80_columns() -> None:
    from rich.console import Console

    from services.views import versions_table, workers_table

    workers = [{"worker_id": f"rollout-{n}-7f9c2d", "engine": "native", "kv_policy": "rkv", "kv_budget": 512,
                "weight_version": 118, "tokens_per_s": 1234.5, "download_mbps": 95.3, "leases": 12,
                "url": None, "updated_at": time.time()} for n in range(3)]
    rows = [{"version": v, "base_version": v - 1, "patch_bytes": 1_234_567, "snapshot_bytes": None,
             "dense_bytes": 3_400_000_000, "payload_ratio": 2754.0, "changed_fraction": 0.0123,
             "metrics": {"reward_mean": 0.4321, "accuracy": 0.5}} for v in range(118, 121)]
    for table, must_show in ((workers_table(workers, 120), ["rollout-2-7f9c2d", "rkv@512", "1234"]),
                             (versions_table(rows, 0), ["v120", "1.2 MB", "3.4 GB", "2754x", "50.0%"])):
        console = Console(width=80, record=True, file=io.StringIO())
        console.print(table)
        text = console.export_text()
        assert max(len(line) for line in text.splitlines()) <= 80
        assert "…" not in text and all(value in text for value in must_show), text
        assert "url" not in text  # no worker advertises one: the column is left out
    with_url = [w | {"url": "http://10.0.0.7:8200"} for w in workers]
    console = Console(width=80, record=True, file=io.StringIO())
    console.print(workers_table(with_url, 120))
    assert "url" in console.export_text()


@pytest.mark.parametrize("service", ["registry", "trainer", "rollout"])
def test_service_help_prints_its_settings_and_exits(service: str) -> None:
    shown = subprocess.run([sys.executable, "-m", f"services.{service}", "--help"], cwd=REPO_ROOT,
                           capture_output=True, text=True, timeout=120)
    assert shown.returncode == 0, shown.stderr
    assert "SPARSECAST_PORT" in shown.stdout and "SPARSECAST_RUN" in shown.stdout and "'demo'" in shown.stdout
    refused = subprocess.run([sys.executable, "-m", f"services.{service}", "--port", "1"], cwd=REPO_ROOT,
                             capture_output=True, text=True, timeout=120)
    assert refused.returncode == 2 and "takes no arguments" in refused.stderr


def test_demo_kv_calibrate_takes_a_share() -> None:
    from services.cli import build_parser

    parser = build_parser()
    assert parser.parse_args(["demo", "--kv-calibrate", "0.7"]).kv_calibrate == 0.7
    assert parser.parse_args(["demo"]).kv_calibrate is None  # off unless asked: DemoOptions' default
    for bad in ("0", "1.5", "x"):
        with pytest.raises(SystemExit):
            parser.parse_args(["demo", "--kv-calibrate", bad])
