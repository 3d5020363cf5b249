"""The registry on a real S3-speaking server (moto in server mode): publish, plan, sync, retention,
restart recovery — the same code path a MinIO or AWS deployment takes."""

from __future__ import annotations

from collections.abc import Iterator

import boto3
import pytest
from moto.server import ThreadedMotoServer

from services.registry.app import create_app
from services.registry.settings import RegistrySettings
from shared.ports import free_port
from shared.registry.client import RegistryClient
from shared.registry.sync import sync_weights
from tests.conftest import serve_app
from tests.integration.registry_helpers import TOKEN, clone, make_chain, same

RUN = "s3run"


@pytest.fixture(scope="module")
def s3_endpoint() -> Iterator[str]:
    port = free_port()
    server = ThreadedMotoServer(ip_address="127.0.0.1", port=port, verbose=False)
    server.start()
    try:
        yield f"http://127.0.0.1:{port}"
    finally:
        server.stop()


def s3_settings(endpoint: str, bucket: str) -> RegistrySettings:
    boto3.client(
        "s3",
        endpoint_url=endpoint,
        region_name="us-east-1",
        aws_access_key_id="test",
        aws_secret_access_key="test",
    ).create_bucket(Bucket=bucket)
    return RegistrySettings(
        store_url=f"s3://{bucket}/registry",
        store_options={"endpoint": endpoint, "region": "us-east-1", "access_key_id": "test",
                       "secret_access_key": "test", "allow_http": "true"},
        api_token=TOKEN, piece_bytes=4096, snapshot_every=0, plan_lease_s=0, keep_snapshots=1,
    )


async def test_s3_round_trip_retention_and_restart(s3_endpoint: str) -> None:
    chain = make_chain(RUN, 5, seed=3)
    settings = s3_settings(s3_endpoint, "sparsecast-test")
    with serve_app(create_app(settings)) as url:
        async with RegistryClient(url, RUN, token=TOKEN, streams=3) as client:
            await client.publish_snapshot(0, chain.snapshot(0))
            for v in range(1, 5):
                await client.publish_patch(v, chain.patches[v], {"step": v})
            state = clone(chain.states[1])
            result = await sync_weights(client, state, 1)
            assert result.path == "merged" and same(state, chain.states[4])
            # A second snapshot with keep_snapshots=1 retires everything below version 4.
            await client.publish_snapshot(4, chain.snapshot(4))
            assert [m.version for m in await client.versions()] == [4]
    s3 = boto3.client(
        "s3",
        endpoint_url=s3_endpoint,
        region_name="us-east-1",
        aws_access_key_id="test",
        aws_secret_access_key="test",
    )
    keys = {o["Key"] for o in s3.list_objects_v2(Bucket="sparsecast-test")["Contents"]}
    assert f"registry/{RUN}/snapshots/4.safetensors" in keys
    assert (
        f"registry/{RUN}/snapshots/0.safetensors" not in keys
        and f"registry/{RUN}/merged/1-4.patch" not in keys
    )
    # A restarted registry finds its head by listing the bucket.
    with serve_app(create_app(settings)) as url:
        async with RegistryClient(url, RUN, token=TOKEN) as client:
            assert (await client.latest()).version == 4
            await client.publish_patch(5, chain.patches[5])
            fresh: dict = {}
            assert (await sync_weights(client, fresh, None)).version == 5 and same(fresh, chain.states[5])
