"""/docs and /redoc work without internet: the pages load Swagger UI and ReDoc from the service itself
(fastapi-offline's packaged assets), never from a CDN."""

from __future__ import annotations

import re
from pathlib import Path

import pytest
from fastapi.testclient import TestClient

from services.registry.app import create_app as create_registry
from services.registry.settings import RegistrySettings
from services.rollout.app import create_app as create_rollout
from services.rollout.settings import RolloutSettings
from services.trainer.app import create_app as create_trainer
from services.trainer.settings import TrainerSettings


def apps(tmp_path: Path) -> dict:
    return {
        "registry": create_registry(RegistrySettings(store_url="memory://")),
        "trainer": create_trainer(TrainerSettings(data_dir=str(tmp_path / "trainer"), device="cpu")),
        "rollout": create_rollout(RolloutSettings(data_dir=str(tmp_path / "rollout"), device="cpu")),
    }


@pytest.mark.parametrize("service", ["registry", "trainer", "rollout"])
def test_docs_pages_load_their_assets_from_the_service(service: str, tmp_path: Path) -> None:
    client = TestClient(apps(tmp_path)[service])  # no lifespan: the pages need no running service
    for page, asset in (("/docs", "swagger-ui-bundle.js"), ("/redoc", "redoc.standalone.js")):
        html = client.get(page)
        assert html.status_code == 200 and "text/html" in html.headers["content-type"]
        sources = re.findall(r'(?:src|href)="([^"]+)"', html.text)
        assert sources and all(s.startswith("/") for s in sources), sources  # nothing off the host
        assert "cdn" not in html.text.lower() and "fonts.googleapis" not in html.text
        [script] = [s for s in sources if s.endswith(asset)]
        served = client.get(script)
        assert served.status_code == 200 and len(served.content) > 100_000, (page, script)
    assert client.get("/openapi.json").json()["info"]["title"] == f"sparsecast {service}"
