"""The rollout directive (the workers' KV budget) through the registry: from the publisher's
header into the stored manifest and back, refused when malformed, absent in older manifests."""

from __future__ import annotations

import json
from pathlib import Path

import httpx

from services.registry.app import create_app
from services.registry.settings import RegistrySettings
from shared.registry.client import RegistryClient
from shared.registry.wire import ROLLOUT_HEADER, Manifest, RolloutDirective
from tests.conftest import serve_app
from tests.integration.registry_helpers import TOKEN, make_chain

RUN = "kv"
AUTH = {"Authorization": f"Bearer {TOKEN}"}


def _settings(tmp_path: Path) -> RegistrySettings:
    return RegistrySettings(store_url=f"file://{tmp_path}/store", api_token=TOKEN, snapshot_every=0,
                            plan_lease_s=0)


async def test_the_directive_round_trips_and_survives_a_restart(tmp_path: Path) -> None:
    chain = make_chain(RUN, 3)
    with serve_app(create_app(_settings(tmp_path))) as url:
        async with RegistryClient(url, RUN, token=TOKEN) as client:
            v0 = await client.publish_snapshot(0, chain.snapshot(0), RolloutDirective(kv_budget=32))
            assert v0.rollout.kv_budget == 32
            await client.publish_patch(1, chain.patches[1], {"loss": 1.0}, RolloutDirective(kv_budget=40))
            await client.publish_patch(2, chain.patches[2], {"loss": 2.0})  # none: the workers' own
            # A snapshot of a committed version keeps the directive published with it.
            again = await client.publish_snapshot(1, chain.snapshot(1), RolloutDirective(kv_budget=99))
            assert again.rollout.kv_budget == 40
            assert [m.rollout.kv_budget for m in await client.versions()] == [32, 40, None]
            assert (await client.manifest(1)).rollout == RolloutDirective(kv_budget=40)
    with serve_app(create_app(_settings(tmp_path))) as url:  # a new process reads the store
        async with RegistryClient(url, RUN, token=TOKEN) as client:
            assert (await client.manifest(1)).rollout.kv_budget == 40
            assert (await client.latest()).rollout.kv_budget is None


async def test_a_malformed_header_is_a_422_and_nothing_is_published(tmp_path: Path) -> None:
    chain = make_chain(RUN, 1)
    with serve_app(create_app(_settings(tmp_path))) as url:
        base = f"{url}/v1/runs/{RUN}"
        async with httpx.AsyncClient() as http:
            for bad in ("not json", "[32]", '{"kv_budget": 0}', '{"kv_budget": "32"}', '{"kv_budget": 3.5}',
                        '{"kv_budget": true}', '{"kv_budgte": 32}'):
                for path, body in (("snapshots/0", chain.snapshot(0)), ("patches/1", chain.patches[1])):
                    response = await http.put(f"{base}/{path}", content=body,
                                              headers={**AUTH, ROLLOUT_HEADER: bad})
                    assert response.status_code == 422, (bad, path, response.text)
                    assert ROLLOUT_HEADER in response.json()["detail"], response.text
            assert (await http.get(f"{base}/latest")).status_code == 404
            ok = await http.put(f"{base}/snapshots/0", content=chain.snapshot(0),
                                headers={**AUTH, ROLLOUT_HEADER: '{"kv_budget": 24}'})
            assert ok.status_code == 200 and ok.json()["rollout"] == {"kv_budget": 24}


async def test_a_manifest_stored_before_the_field_still_loads(tmp_path: Path) -> None:
    chain = make_chain(RUN, 1)
    with serve_app(create_app(_settings(tmp_path))) as url:
        async with RegistryClient(url, RUN, token=TOKEN) as client:
            await client.publish_snapshot(0, chain.snapshot(0), RolloutDirective(kv_budget=32))
    stored = tmp_path / "store" / RUN / "manifests" / "0.json"
    old = json.loads(stored.read_text())
    del old["rollout"]
    stored.write_text(json.dumps(old))
    with serve_app(create_app(_settings(tmp_path))) as url:
        async with RegistryClient(url, RUN, token=TOKEN) as client:
            head = await client.latest()
            assert head is not None and head.rollout.kv_budget is None
            await client.publish_patch(1, chain.patches[1], rollout=RolloutDirective(kv_budget=48))
            assert (await client.latest()).rollout.kv_budget == 48
    # A newer manifest with fields this version does not know still loads.
    newer = Manifest.model_validate(old | {"rollout": {"kv_budget": 8, "kv_policy": "snapkv"}})
    assert newer.rollout.kv_budget == 8
