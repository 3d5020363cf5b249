"""Separate credentials over real HTTP (issue 27): with SPARSECAST_PUBLISH_TOKEN set, only it
publishes (patches, snapshots, model files); the API token a worker may hold for relay
announcements cannot. Unset, the API token still publishes, with one deprecation warning."""

from __future__ import annotations

import logging
from pathlib import Path

import httpx
import pytest

from services.registry.app import create_app
from services.registry.settings import RegistrySettings
from shared.registry.client import RegistryClient
from shared.registry.errors import RegistryHTTPError
from tests.conftest import serve_app
from tests.integration.registry_helpers import make_chain

RUN = "creds"
API, PUBLISH = "api-token-of-everyone", "publish-token-of-the-trainer"


def bearer(token: str) -> dict[str, str]:
    return {"Authorization": f"Bearer {token}"}


async def test_only_the_publish_token_publishes(tmp_path: Path) -> None:
    chain = make_chain(RUN, 1)
    settings = RegistrySettings(store_url=f"file://{tmp_path}/store", api_token=API, publish_token=PUBLISH,
                                snapshot_every=0)
    with serve_app(create_app(settings)) as url:
        for token in (API, "wrong", None):
            async with RegistryClient(url, RUN, token=token) as client:
                for publish in (lambda c: c.publish_snapshot(0, chain.snapshot(0)),
                                lambda c: c.put_model_file("config.json", b"{}")):
                    with pytest.raises(RegistryHTTPError) as refused:
                        await publish(client)
                    assert refused.value.status == 401
        async with RegistryClient(url, RUN, token=PUBLISH) as trainer:
            await trainer.publish_snapshot(0, chain.snapshot(0))
            await trainer.publish_patch(1, chain.patches[1], {"loss": 0.1})
            await trainer.put_model_file("config.json", b"{}")
            assert (await trainer.latest()).version == 1
        # A worker's relay announcement takes the API token (the publish token is no worker's).
        peer = {"url": "http://10.0.0.7:8200", "objects": ["patches/0-1.patch"]}
        async with httpx.AsyncClient(base_url=url) as http:
            announced = await http.put(f"/v1/runs/{RUN}/peers/w1", json=peer, headers=bearer(API))
            assert announced.status_code == 200
            assert (await http.put(f"/v1/runs/{RUN}/peers/w2", json=peer)).status_code == 401


async def test_without_a_publish_token_the_api_token_publishes_with_a_warning(
        tmp_path: Path, caplog: pytest.LogCaptureFixture, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr("shared.settings._warned_fallback", set())  # as in a fresh process
    caplog.set_level(logging.WARNING)
    chain = make_chain(RUN, 1)
    settings = RegistrySettings(store_url=f"file://{tmp_path}/store", api_token=API, snapshot_every=0)
    with serve_app(create_app(settings)) as url:
        async with RegistryClient(url, RUN, token=API) as client:
            await client.publish_snapshot(0, chain.snapshot(0))
    create_app(settings)  # a second app in the same process: not warned again
    deprecations = [m for m in (r.getMessage() for r in caplog.records) if "PUBLISH_TOKEN is unset" in m]
    assert len(deprecations) == 1
    assert deprecations[0].startswith("registry:") and "deprecated" in deprecations[0]
