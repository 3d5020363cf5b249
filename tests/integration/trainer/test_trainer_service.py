"""The trainer service over real HTTP with a real registry and Redis: REST API, bad input,
pause/resume, checkpoint and resume at the same version."""

from __future__ import annotations

import json
import time
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path

import httpx
import pytest

from services.registry.app import create_app as create_registry
from services.registry.settings import RegistrySettings
from services.trainer.app import create_app as create_trainer
from services.trainer.settings import TrainerSettings
from shared.coord import CoordSettings
from tests.conftest import serve_app

TOKEN = "trainer-test-token"
AUTH = {"Authorization": f"Bearer {TOKEN}"}


def wait_ready(url: str, timeout: float = 120) -> dict:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        r = httpx.get(f"{url}/readyz")
        if r.status_code == 200:
            return r.json()
        assert r.json().get("error") is None, r.json()
        time.sleep(0.1)
    raise AssertionError("trainer not ready")


@contextmanager
def stack(
    tmp_path: Path, model_dir: str, redis_url: str, redis_prefix: str, **trainer_overrides
) -> Iterator[tuple[str, str]]:
    reg = RegistrySettings(store_url=f"file://{tmp_path / 'store'}", api_token=TOKEN)
    with serve_app(create_registry(reg)) as registry_url:
        settings = TrainerSettings(model=model_dir, device="cpu", data_dir=str(tmp_path / "trainer"), run="t",
                                   api_token=TOKEN, registry_url=registry_url, redis_url=redis_url,
                                   redis_prefix=redis_prefix, coord=CoordSettings(max_queue=50),
                                   **trainer_overrides)
        with serve_app(create_trainer(settings)) as trainer_url:
            wait_ready(trainer_url)
            yield trainer_url, registry_url


@pytest.fixture
def trainer_url(tmp_path: Path, tiny_model_dir: str, redis_url: str, redis_prefix: str) -> Iterator[str]:
    with stack(tmp_path, tiny_model_dir, redis_url, redis_prefix) as (url, _):
        yield url


@pytest.fixture(scope="module")
def idle_trainer_url(tmp_path_factory: pytest.TempPathFactory, tiny_model_dir: str) -> Iterator[str]:
    """One trainer for the tests that enqueue nothing (bad input, control endpoints)."""
    import redis

    from tests.conftest import REDIS_URL

    prefix = f"test:idle-trainer-{time.time_ns()}"
    with stack(tmp_path_factory.mktemp("idle"), tiny_model_dir, REDIS_URL, prefix) as (url, _):
        yield url
    client = redis.Redis.from_url(REDIS_URL)
    keys = list(client.scan_iter(match=f"{prefix}*"))
    if keys:
        client.delete(*keys)
    client.close()


def test_prompts_in_every_form(trainer_url: str) -> None:
    url = f"{trainer_url}/v1/prompts"
    r = httpx.post(
        url,
        json={"task": "addition", "samples_per_prompt": 4, "generate": {"count": 5, "seed": 1}},
        headers=AUTH,
    )
    assert r.status_code == 200, r.text
    assert r.json()["count"] == 5 and r.json()["samples_per_prompt"] == 4 and len(set(r.json()["ids"])) == 5

    r = httpx.post(url, json={"prompts": [{"prompt": "1+2=", "answer": "3", "id": "mine"}]}, headers=AUTH)
    assert r.status_code == 200 and r.json()["ids"] == ["mine"] and r.json()["task"] == "addition"

    jsonl = b'{"question": "Tom has 3 apples and buys 4. How many?", "answer": "3 + 4 = 7\\n#### 7"}\n\n' \
            b'{"prompt": "2+2=", "answer": "4"}\n'
    r = httpx.post(f"{url}?task=gsm8k&samples_per_prompt=2", content=jsonl,
                   headers=AUTH | {"content-type": "application/x-ndjson"})
    assert r.status_code == 200, r.text
    assert r.json()["count"] == 2 and r.json()["task"] == "gsm8k"

    r = httpx.post(
        f"{url}?task=gsm8k", files={"file": ("p.jsonl", jsonl, "application/x-ndjson")}, headers=AUTH
    )
    assert r.status_code == 200 and r.json()["count"] == 2

    status = httpx.get(f"{trainer_url}/v1/status").json()
    assert status["queue"]["enqueued"] == 10 and status["queue"]["prompts_queued"] == 10
    assert status["version"] == 0 and status["step"] == 0


@pytest.mark.parametrize(
    ("kwargs", "status", "needle"),
    [
        ({"json": {"generate": {"count": 1}}, "headers": {}}, 401, "token"),
        ({"json": {"generate": {"count": 1}}, "headers": {"Authorization": "Bearer nope"}}, 401, "token"),
        ({"json": {"task": "chess", "generate": {"count": 1}}}, 400, "unknown task"),
        ({"json": {"prompts": []}}, 400, "no prompts"),
        ({"json": {"prompts": [{"prompt": ""}]}}, 422, "prompt"),
        ({"json": {"prompts": [{"answer": "3"}]}}, 422, "prompt"),
        ({"json": {"generate": {"count": 0}}}, 422, "count"),
        ({"json": {"generate": {"count": 2}, "prompts": [{"prompt": "x"}]}}, 422, "exactly one"),
        ({"json": {"task": "gsm8k", "generate": {"count": 2}}}, 400, "cannot generate"),
        ({"json": {"generate": {"count": 2}, "samples_per_prompt": 0}}, 422, "samples_per_prompt"),
        ({"json": {"generate": {"count": 2}, "colour": "red"}}, 422, "colour"),
        ({"content": b"{bad json", "headers": {"content-type": "application/x-ndjson"}}, 422, "line 1"),
        (
            {
                "content": b'{"question": "q", "answer": "none"}',
                "headers": {"content-type": "application/x-ndjson"},
            },
            422,
            "no final number",
        ),
        (
            {"content": b"[1, 2]", "headers": {"content-type": "application/x-ndjson"}},
            422,
            "expected an object",
        ),
        ({"content": b"hello", "headers": {"content-type": "image/png"}}, 415, "JSONL"),
        ({"json": {"generate": {"count": 51}}}, 429, "queue"),
    ],
)
def test_bad_prompt_requests_get_a_clear_4xx(
    idle_trainer_url: str, kwargs: dict, status: int, needle: str
) -> None:
    trainer_url = idle_trainer_url
    headers = kwargs.pop("headers", {})
    if status != 401:
        headers = AUTH | headers
    r = httpx.post(f"{trainer_url}/v1/prompts", headers=headers, **kwargs)
    assert r.status_code == status, r.text
    assert needle in r.text
    assert httpx.get(f"{trainer_url}/v1/status").json()["queue"]["enqueued"] == 0  # nothing half-queued


def test_control_endpoints(idle_trainer_url: str) -> None:
    trainer_url = idle_trainer_url
    assert httpx.post(f"{trainer_url}/v1/train/pause").status_code == 401
    assert httpx.post(f"{trainer_url}/v1/train/pause", headers=AUTH).json()["paused"] is True
    assert httpx.get(f"{trainer_url}/v1/status").json()["paused"] is True
    assert httpx.post(f"{trainer_url}/v1/train/resume", headers=AUTH).json()["paused"] is False
    versions = httpx.get(f"{trainer_url}/v1/versions").json()["versions"]
    assert [v["version"] for v in versions] == [0] and versions[0]["fingerprint"].startswith("fp1-")
    assert httpx.get(f"{trainer_url}/v1/metrics/history").json() == {"history": []}
    assert httpx.get(f"{trainer_url}/v1/metrics/history?since=-1").status_code == 422
    metrics = httpx.get(f"{trainer_url}/metrics").text
    assert "trainer_version 0.0" in metrics and 'coord{name="prompts_queued"}' in metrics
    r = httpx.post(f"{trainer_url}/v1/checkpoint", headers=AUTH)
    assert r.status_code == 200 and r.json()["version"] == 0


def test_restart_resumes_at_the_same_version(tmp_path: Path, tiny_model_dir: str, redis_url: str,
                                              redis_prefix: str) -> None:
    """Checkpoint, stop, start again: same version, and the registry's fingerprint still matches."""
    with stack(tmp_path, tiny_model_dir, redis_url, redis_prefix) as (url, registry_url):
        assert httpx.post(f"{url}/v1/checkpoint", headers=AUTH).status_code == 200
        head = httpx.get(f"{registry_url}/v1/runs/t/latest").json()
    assert (tmp_path / "trainer" / "checkpoints" / f"v{head['version']:08d}" / "trainer.pt").is_file()
    with stack(tmp_path, tiny_model_dir, redis_url, redis_prefix) as (url, registry_url):
        status = httpx.get(f"{url}/v1/status").json()
        assert status["version"] == head["version"] and status["error"] is None
        assert httpx.get(f"{registry_url}/v1/runs/t/latest").json()["fingerprint"] == head["fingerprint"]
    lines = (tmp_path / "trainer" / "metrics.jsonl")
    assert not lines.exists() or all(json.loads(x) for x in lines.read_text().splitlines())
