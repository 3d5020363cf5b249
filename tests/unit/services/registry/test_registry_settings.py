"""The registry's store settings as an operator writes them: one variable per option."""

from __future__ import annotations

from services.registry.settings import RegistrySettings


def test_store_options_from_one_variable_each(monkeypatch) -> None:
    monkeypatch.setenv("SPARSECAST_STORE_URL", "s3://bucket/runs")
    monkeypatch.setenv("SPARSECAST_STORE_OPTIONS__ENDPOINT", "http://minio:9000")
    monkeypatch.setenv("SPARSECAST_STORE_OPTIONS__ALLOW_HTTP", "true")
    settings = RegistrySettings()
    assert settings.store_options == {"endpoint": "http://minio:9000", "allow_http": "true"}
