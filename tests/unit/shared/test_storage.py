"""Opening object stores: one generic path from a URL and options in obstore's names."""

from __future__ import annotations

import pytest

from shared.storage import CLIENT_OPTION_KEYS, ObjectNotFound, ObjectStorage


async def test_file_store_round_trip(tmp_path) -> None:
    storage = ObjectStorage(f"file://{tmp_path}/store")
    await storage.put("run/a", b"abc")
    assert await storage.get("run/a") == b"abc"
    assert await storage.get_range("run/a", 1, 3) == b"bc"
    with pytest.raises(ObjectNotFound):
        await storage.get("run/missing")


def test_file_and_memory_refuse_options(tmp_path) -> None:
    with pytest.raises(ValueError, match="takes no store options"):
        ObjectStorage(f"file://{tmp_path}", options={"region": "x"})
    with pytest.raises(ValueError, match="takes no store options"):
        ObjectStorage("memory://", options={"endpoint": "x"})


def test_unknown_scheme_and_option_are_clear_errors() -> None:
    with pytest.raises(ValueError, match="cannot open store 'ftp://host/x'"):
        ObjectStorage("ftp://host/x")
    with pytest.raises(ValueError, match="no_such_option"):
        ObjectStorage("s3://bucket/prefix", options={"no_such_option": "1"})
    with pytest.raises(ValueError, match="allow_http must be true or false"):
        ObjectStorage("s3://bucket/prefix", options={"allow_http": "maybe"})


def test_stores_open_from_url_and_options_alone() -> None:
    # Neither store has code of its own here: the URL scheme picks obstore's store, the options
    # split into client settings and store configuration. Opening makes no request.
    s3 = ObjectStorage("s3://bucket/runs", options={
        "endpoint": "http://127.0.0.1:9", "region": "us-east-1", "access_key_id": "k",
        "secret_access_key": "s", "ALLOW_HTTP": "true", "timeout": "5s",
    })
    assert type(s3._store).__name__ == "S3Store"
    gcs = ObjectStorage("gs://bucket/runs", options={"bucket": "bucket"})
    assert type(gcs._store).__name__ == "GCSStore"
    assert {"allow_http", "timeout"} <= CLIENT_OPTION_KEYS
    assert "endpoint" not in CLIENT_OPTION_KEYS

