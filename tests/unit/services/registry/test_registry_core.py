"""services.registry.core over an in-memory store: publish rules, planning, retention, recovery."""

from __future__ import annotations

import pytest

from services.registry.core import Registry
from services.registry.errors import BadRange, Conflict, Invalid, NotFound, RegistryError, TooLarge
from services.registry.ranges import parse_range
from services.registry.runs import piece_hashes
from services.registry.settings import RegistrySettings
from services.registry.uploads import MAX_MODEL_FILE_BYTES, UploadCheck
from shared.patch import apply_patch, extract_patch, fingerprint, load_snapshot
from shared.storage import ObjectStorage
from tests.integration.registry_helpers import Chain, clone, make_chain, publish, same, step

RUN = "r1"


@pytest.fixture(scope="module")
def chain() -> Chain:
    return make_chain(RUN, 8)


def new_registry(storage: ObjectStorage | None = None, **overrides) -> Registry:
    values = {"store_url": "memory://", "piece_bytes": 4096, "snapshot_every": 0, "plan_lease_s": 0}
    settings = RegistrySettings(**{**values, **overrides})
    return Registry(storage or ObjectStorage("memory://"), settings)


async def test_publish_rules(chain: Chain) -> None:
    registry = new_registry()
    with pytest.raises(Conflict, match="first version must be a snapshot"):
        await registry.publish_patch(RUN, 1, chain.patches[1], {})
    first = await registry.publish_snapshot(RUN, 0, chain.snapshot(0))
    assert first.fingerprint == fingerprint(chain.states[0]) and first.patch is None
    with pytest.raises(Conflict, match="not the next one"):
        await registry.publish_patch(RUN, 2, chain.patches[2], {})
    with pytest.raises(Invalid, match="malformed patch"):
        await registry.publish_patch(RUN, 1, chain.patches[1][:-10], {})
    with pytest.raises(Invalid, match="malformed patch"):
        await registry.publish_patch(RUN, 1, b"not a patch at all", {})
    # A patch whose base is other weights: the fingerprint check refuses it.
    stray = extract_patch(
        step(chain.states[0], 99), chain.states[1], run=RUN, base_version=0, target_version=1
    )
    with pytest.raises(Conflict, match="base fingerprint"):
        await registry.publish_patch(RUN, 1, stray, {})
    other_run = extract_patch(chain.states[0], chain.states[1], run="other", base_version=0, target_version=1)
    with pytest.raises(Conflict, match="expected r1:0→1"):
        await registry.publish_patch(RUN, 1, other_run, {})
    m1 = await registry.publish_patch(RUN, 1, chain.patches[1], {"loss": 0.5})
    assert m1.metrics == {"loss": 0.5} and m1.base_version == 0 and m1.patch.key == "patches/0-1.patch"
    assert m1.payload_ratio and m1.payload_ratio > 1
    with pytest.raises(Conflict, match="versions advance through patches"):
        await registry.publish_snapshot(RUN, 2, chain.snapshot(2))
    with pytest.raises(Conflict, match="expected r1:0"):
        await registry.publish_snapshot(RUN, 0, chain.snapshot(1))
    with pytest.raises(Invalid, match="malformed snapshot"):
        await registry.publish_snapshot(RUN, 1, b"\x08" + bytes(20))
    m1s = await registry.publish_snapshot(RUN, 1, chain.snapshot(1))
    assert m1s.snapshot is not None and m1s.patch == m1.patch and m1s.metrics == {"loss": 0.5}
    assert [m.version for m in await registry.versions(RUN)] == [0, 1]
    with pytest.raises(Invalid, match="bad run name"):
        await registry.versions("../etc")


async def test_plans_pick_the_fewest_bytes(chain: Chain) -> None:
    registry = new_registry()
    await publish(registry, chain, 6, snapshots=(0, 4))
    assert (await registry.plan(RUN, 6, None)).kind == "none"
    one = await registry.plan(RUN, 5, None)
    assert one.kind == "chain" and [s.object.key for s in one.steps] == ["patches/5-6.patch"]
    merged = await registry.plan(RUN, 2, 6)
    chain_bytes = sum(len(chain.patches[v]) for v in range(3, 7))
    assert merged.kind == "merged" and merged.total_bytes < chain_bytes
    assert await registry.storage.exists(f"{RUN}/merged/2-6.patch")
    fresh = await registry.plan(RUN, None, None)
    assert fresh.kind == "snapshot" and [s.object.key for s in fresh.steps] == [
        "snapshots/4.safetensors", "merged/4-6.patch",
    ]
    assert fresh.total_bytes < (await registry.manifest(RUN, 4)).snapshot.size + len(chain.patches[5]) + len(
        chain.patches[6]
    )
    assert [s.object.key for s in (await registry.plan(RUN, None, 5)).steps] == [
        "snapshots/4.safetensors", "patches/4-5.patch",
    ]
    # Every plan, applied from its start, lands on the target bit-exactly.
    for a, target in ((2, 6), (5, 6), (0, 3), (None, 6)):
        plan = await registry.plan(RUN, a, target)
        state = clone(chain.states[a]) if a is not None else {}
        for s in plan.steps:
            blob = await registry.storage.get(f"{RUN}/{s.object.key}")
            if s.kind == "snapshot":
                state = load_snapshot(blob)[0]
            else:
                apply_patch(state, blob)
        assert same(state, chain.states[target]) and fingerprint(state) == plan.fingerprint
    with pytest.raises(Invalid, match="cannot plan"):
        await registry.plan(RUN, 6, 3)
    with pytest.raises(NotFound):
        await registry.plan(RUN, 0, 7)
    # With merging turned off the chain is planned.
    assert (await new_registry(registry.storage, max_merge_lag=0).plan(RUN, 2, 6)).kind == "chain"


async def test_restart_recovers_head_and_merged_cache(chain: Chain) -> None:
    storage = ObjectStorage("memory://")
    registry = new_registry(storage)
    await publish(registry, chain, 4)
    await registry.plan(RUN, 1, 4)
    # A crash mid-publish: the patch object landed, its manifest did not.
    await storage.put(f"{RUN}/patches/4-5.patch", chain.patches[5])
    restarted = new_registry(storage)
    assert (await restarted.manifest(RUN)).version == 4
    assert (1, 4) in (await restarted._run(RUN)).merged
    await restarted.publish_patch(RUN, 5, chain.patches[5], {})
    assert (await restarted.manifest(RUN)).version == 5


async def test_retention_keeps_plans_and_leased_objects(chain: Chain) -> None:
    registry = new_registry(keep_snapshots=2)
    await publish(registry, chain, 8, snapshots=(0, 3, 6))
    # Floor = 3 (last two snapshots: 3, 6); versions below it are gone, manifests first.
    assert [m.version for m in await registry.versions(RUN)] == list(range(3, 9))
    keys = {o.key for o in await registry.storage.list(f"{RUN}/")}
    assert f"{RUN}/snapshots/0.safetensors" not in keys and f"{RUN}/patches/1-2.patch" not in keys
    assert f"{RUN}/snapshots/3.safetensors" in keys and f"{RUN}/patches/7-8.patch" in keys
    # A worker below the floor is sent a snapshot; one above it still gets patches.
    assert (await registry.plan(RUN, 1, None)).kind == "snapshot"
    assert (await registry.plan(RUN, 7, None)).kind == "chain"

    leased = new_registry(keep_snapshots=1, plan_lease_s=3600)
    leased._started -= 3600  # past the restart grace period
    await publish(leased, chain, 3)
    plan = await leased.plan(RUN, None, None)  # snapshot 0 + chain, leased for an hour
    await leased.publish_snapshot(RUN, 3, chain.snapshot(3))
    assert plan.steps[0].object.key == "snapshots/0.safetensors"
    assert await leased.storage.exists(f"{RUN}/snapshots/0.safetensors")
    assert 0 in (await leased._run(RUN)).manifests


async def test_materialized_snapshots(chain: Chain) -> None:
    registry = new_registry(snapshot_every=2)
    await publish(registry, chain, 3)
    await registry.idle()
    state = await registry._run(RUN)
    assert state.snapshots() == [0, 2]
    assert same(await registry.state_at(RUN, 3), chain.states[3])


async def test_model_files_and_object_keys() -> None:
    registry = new_registry()
    await registry.put_model_file(RUN, "config.json", b'{"hidden_size": 8}')
    assert await registry.model_files(RUN) == ["config.json"]
    assert await registry.get_model_file(RUN, "config.json") == b'{"hidden_size": 8}'
    for name in ("model.safetensors", "../config.json", "x/config.json"):
        with pytest.raises(Invalid):
            await registry.put_model_file(RUN, name, b"{}")
    with pytest.raises(Invalid, match="not valid JSON"):
        await registry.put_model_file(RUN, "tokenizer.json", b"{")
    with pytest.raises(NotFound):
        await registry.get_model_file(RUN, "tokenizer.json")
    for key in ("../x", "patches/../../x", "secrets/x", "patches//x", ""):
        with pytest.raises(Invalid):
            registry.object_key(RUN, key)
    assert registry.object_key(RUN, "patches/0-1.patch") == f"{RUN}/patches/0-1.patch"


def test_parse_range() -> None:
    assert parse_range(None, 100) is None
    assert parse_range("bytes=0-9", 100) == (0, 10)
    assert parse_range("bytes=90-", 100) == (90, 100)
    assert parse_range("bytes=-10", 100) == (90, 100)
    assert parse_range("bytes=50-1000", 100) == (50, 100)
    for bad in ("bytes=100-", "bytes=5-2", "bytes=0-1,4-5", "items=0-1", "bytes=-", "bytes=abc"):
        with pytest.raises(BadRange):
            parse_range(bad, 100)


def test_piece_hashes_cover_the_object() -> None:
    data = bytes(range(251)) * 40  # 251 does not divide 4096: every piece differs
    hashes = piece_hashes(data, 4096)
    assert len(hashes) == 3 and len(set(hashes)) == 3
    assert piece_hashes(data, len(data)) == piece_hashes(data, 1 << 20)


def _feed(check: UploadCheck, data: bytes, piece: int = 7) -> None:
    for i in range(0, len(data), piece):
        check.feed(data[i : i + piece])


def test_uploads_are_checked_as_they_stream_in(chain: Chain) -> None:
    patch, snapshot = chain.patches[1], chain.snapshot(0)
    for kind, body in (("patch", patch), ("snapshot", snapshot), ("model", b' {"a": 1}')):
        check = UploadCheck(kind, 1 << 30, len(body))
        _feed(check, body)
        assert check.finish() == body and check.expected in (len(body), None)
    # Junk is refused within its first bytes, whatever length it claims.
    for kind, junk, needle in (("patch", b"SCPATCH\1", "bad magic"), ("patch", b"X", "bad magic"),
                               ("snapshot", b"\x10" + bytes(7) + b"[", "safetensors"),
                               ("model", b"  [1, 2]", "JSON object")):
        check = UploadCheck(kind, 1 << 40, 300 << 20 if kind != "model" else MAX_MODEL_FILE_BYTES)
        with pytest.raises(Invalid, match=needle):
            _feed(check, junk, 1)
    # A body longer or shorter than its header declares.
    with pytest.raises(Invalid, match="longer than"):
        _feed(UploadCheck("patch", 1 << 30), patch + b"\0")
    with pytest.raises(Invalid, match="Content-Length"):
        _feed(UploadCheck("patch", 1 << 30, len(patch) + 5), patch)
    short = UploadCheck("patch", 1 << 30)
    _feed(short, patch[:-3])
    with pytest.raises(Invalid, match="truncated"):
        short.finish()
    # Limits: declared, streamed, and the size a header declares.
    with pytest.raises(TooLarge):
        UploadCheck("patch", 100, 101)
    with pytest.raises(TooLarge):
        UploadCheck("model", 1 << 40, MAX_MODEL_FILE_BYTES + 1)
    with pytest.raises(TooLarge):
        _feed(UploadCheck("model", 10), b"{" + b" " * 20)
    with pytest.raises(TooLarge, match="patch of"):
        _feed(UploadCheck("patch", len(patch) - 1), patch[:-1])
    with pytest.raises(RegistryError, match="empty"):
        UploadCheck("patch", 100).finish()


async def test_plans_without_build_merges_write_nothing_and_publish_builds_them(chain: Chain) -> None:
    registry = new_registry()
    await publish(registry, chain, 4)
    await registry.idle()
    before = {o.key for o in await registry.storage.list(f"{RUN}/")}
    assert (await registry.plan(RUN, 1, None, build_merges=False)).kind == "chain"
    assert (await registry.plan(RUN, None, None, build_merges=False)).kind == "snapshot"
    assert {o.key for o in await registry.storage.list(f"{RUN}/")} == before
    await registry.publish_patch(RUN, 5, chain.patches[5], {})
    await registry.idle()
    keys = {o.key for o in await registry.storage.list(f"{RUN}/merged/")}
    # The lag wanted (4 − 1 = 3) ends at the new head: 2→5; and snapshot 0 → head for fresh workers.
    assert keys == {f"{RUN}/merged/{a}-5.{ext}" for a in (0, 2) for ext in ("patch", "json")}
    assert (await registry.plan(RUN, 2, None, build_merges=False)).kind == "merged"
    # Wishes expire; at most max_publish_merges are built per publish.
    quiet = new_registry(merge_demand_s=0)
    await publish(quiet, chain, 4)
    await quiet.idle()
    await quiet.plan(RUN, 1, None, build_merges=False)
    await quiet.publish_patch(RUN, 5, chain.patches[5], {})
    await quiet.idle()
    assert not await quiet.storage.list(f"{RUN}/merged/")
    capped = new_registry(max_publish_merges=1)
    await publish(capped, chain, 5)
    await capped.idle()
    for a in (1, 2):
        await capped.plan(RUN, a, None, build_merges=False)
    await capped.publish_patch(RUN, 6, chain.patches[6], {})
    await capped.idle()
    # Lags 4 and 3 were wanted, lag 3 last: only 3→6 is built.
    assert [o.key for o in await capped.storage.list(f"{RUN}/merged/")] == [
        f"{RUN}/merged/3-6.json",
        f"{RUN}/merged/3-6.patch",
    ]
