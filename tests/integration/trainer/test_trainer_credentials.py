"""The trainer publishes with its publish token, not with the API token that submits prompts
(issue 27, least privilege): against a registry that requires a publish token, a trainer holding
it publishes v0 and becomes ready; one holding only the API token is refused and says so."""

from __future__ import annotations

import time
from pathlib import Path

import httpx

from services.registry.app import create_app as create_registry
from services.registry.settings import RegistrySettings
from services.trainer.app import create_app as create_trainer
from services.trainer.settings import TrainerSettings
from tests.conftest import serve_app
from tests.integration.trainer.test_trainer_service import TOKEN, wait_ready

PUBLISH = "the-trainers-publish-token"


def trainer_settings(tmp_path: Path, model_dir: str, registry_url: str, redis_url: str,
                     redis_prefix: str, **extra: str) -> TrainerSettings:
    return TrainerSettings(model=model_dir, device="cpu", data_dir=str(tmp_path / "trainer"), run="t",
                           api_token=TOKEN, registry_url=registry_url, redis_url=redis_url,
                           redis_prefix=redis_prefix, **extra)


def test_the_trainer_publishes_with_the_publish_token(tmp_path: Path, tiny_model_dir: str, redis_url: str,
                                                      redis_prefix: str) -> None:
    registry = RegistrySettings(store_url=f"file://{tmp_path / 'store'}", api_token=TOKEN,
                                publish_token=PUBLISH)
    with serve_app(create_registry(registry)) as registry_url:
        settings = trainer_settings(tmp_path / "a", tiny_model_dir, registry_url, redis_url, redis_prefix,
                                    publish_token=PUBLISH)
        with serve_app(create_trainer(settings)) as trainer_url:
            wait_ready(trainer_url)
        assert httpx.get(f"{registry_url}/v1/runs/t/latest").json()["version"] == 0

        # The API token alone cannot publish: the trainer's start fails on the registry's 401.
        settings = trainer_settings(tmp_path / "b", tiny_model_dir, registry_url, redis_url,
                                    redis_prefix + "b")
        settings.run = "t2"
        with serve_app(create_trainer(settings)) as trainer_url:
            deadline = time.monotonic() + 120
            while (error := httpx.get(f"{trainer_url}/v1/status").json()["error"]) is None:
                assert time.monotonic() < deadline, "the trainer neither failed nor published"
                time.sleep(0.2)
        assert "401" in error
        assert httpx.get(f"{registry_url}/v1/runs/t2/latest").status_code == 404
