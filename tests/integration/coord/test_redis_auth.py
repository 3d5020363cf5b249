"""Redis without auth refuses the client (issue 27): a private redis-server started with compose's
own Redis command (its ACL users, the passwords of deploy/env/redis.env) refuses anonymous and
wrongly authenticated clients, and the services' clients log in with the credentials carried by
each role's SPARSECAST_REDIS_URL (deploy/env/{trainer,rollout,registry}.env) and do their work:
the trainer's submissions and reads, a worker's claim and completion, the registry's announcement.
Each role can do no more than its ACL allows."""

from __future__ import annotations

import asyncio
import re
import shlex
from pathlib import Path
from types import SimpleNamespace

import pytest
import redis
import yaml

from services.registry.core import RedisAnnouncer
from services.trainer.ledger import GroupLedger
from shared.coord import Coordinator, connect
from shared.schemas import PromptGroup, Trajectory, WorkerInfo
from tests.paths import REPO_ROOT
from tests.private_redis import PrivateRedis

RUN, PREFIX = "auth", "sparsecast"  # the prefix compose's ACL allows (the services' default)


def env_file(name: str) -> dict[str, str]:
    text = (REPO_ROOT / "deploy" / "env" / name).read_text()
    return dict(re.findall(r"^([A-Z][A-Z0-9_]*)=(.*)$", text, re.MULTILINE))


def compose_redis_args() -> list[str]:
    """redis-server's options in compose.yaml, with the passwords of deploy/env/redis.env."""
    script = yaml.safe_load((REPO_ROOT / "compose.yaml").read_text())["services"]["redis"]["command"][-1]
    script = script.replace("$$", "$")  # compose's escape: the container's shell expands them
    for name, value in env_file("redis.env").items():
        script = script.replace(f"${name}", value)
    assert "$" not in script, script
    words = shlex.split(script)
    return words[words.index("redis-server") + 1:]


def role_url(server: PrivateRedis, role_env: str) -> str:
    """The role's compose SPARSECAST_REDIS_URL, pointed at the private server."""
    url = env_file(role_env)["SPARSECAST_REDIS_URL"]
    assert "@redis:6379/" in url, url
    return url.replace("@redis:6379/", f"@127.0.0.1:{server.port}/")


@pytest.fixture
def server(tmp_path: Path) -> PrivateRedis:
    password = env_file("redis.env")["REDIS_TRAINER_PASSWORD"]
    with PrivateRedis(tmp_path / "redis", args=compose_redis_args(), auth=("trainer", password)) as server:
        yield server


def test_redis_without_auth_refuses_the_client(server: PrivateRedis) -> None:
    anonymous = redis.Redis(host="127.0.0.1", port=server.port, socket_timeout=5)
    with pytest.raises(redis.AuthenticationError):
        anonymous.ping()
    with pytest.raises(redis.AuthenticationError):
        redis.Redis.from_url(role_url(server, "trainer.env").replace("trainer:", "trainer:x", 1)).ping()
    with pytest.raises(redis.AuthenticationError):  # another role's password is no key either
        password = env_file("redis.env")["REDIS_WORKER_PASSWORD"]
        redis.Redis(host="127.0.0.1", port=server.port, username="trainer", password=password).ping()

    async def services_without_credentials() -> None:
        client = connect(f"redis://127.0.0.1:{server.port}/0")  # the services' own client
        try:
            with pytest.raises(redis.AuthenticationError):
                await Coordinator(client, PREFIX, run=RUN).stats()
        finally:
            await client.aclose()

    asyncio.run(services_without_credentials())


def test_the_services_log_in_with_the_credentials_in_their_url(server: PrivateRedis, tmp_path: Path) -> None:
    async def scenario() -> None:
        trainer_redis = connect(role_url(server, "trainer.env"))
        worker_redis = connect(role_url(server, "rollout.env"))
        announcer = RedisAnnouncer(role_url(server, "registry.env"), PREFIX)
        trainer = Coordinator(trainer_redis, PREFIX, run=RUN)
        worker = Coordinator(worker_redis, PREFIX, run=RUN)
        try:
            # The trainer: its ledger's submission, its Redis upkeep (epoch, settings, reconcile).
            ledger = GroupLedger.in_dir(tmp_path, RUN)
            group = PromptGroup(id="g0", task="addition", prompt="1+1=", answer="2", samples=1)
            assert ledger.epoch is not None
            await trainer.check_epoch(ledger.epoch)
            await ledger.submit(trainer, [group])
            await trainer.set_trainer_version(0)
            await trainer.set_inflight_limit(4)
            assert await trainer.missing(["g0"]) == ([], [])
            # A worker: registers, claims, heartbeats, completes.
            await worker.register_worker(WorkerInfo(worker_id="w1"))
            assert await worker.claim_size("w1") >= 1
            leases = await worker.claim("w1", 1)
            assert [lease.group_id for lease in leases] == ["g0"]
            assert await worker.heartbeat_leases(leases)
            done = Trajectory(group_id="g0", attempt=leases[0].attempt, policy_version=0, worker_id="w1",
                              task="addition", prompt="1+1=", samples=[])
            assert await worker.complete(leases[0], done)
            # The trainer reads it; the registry announces a version.
            assert [t.group_id for t in await trainer.next_trajectories(4, min_version=0)] == ["g0"]
            assert [w.worker_id for w in await trainer.workers()] == ["w1"]
            await announcer.announce(RUN, SimpleNamespace(version=1, fingerprint="f" * 16))
            assert await trainer_redis.get(trainer.keys.registry_head) == b"1"
        finally:
            await trainer_redis.aclose()
            await worker_redis.aclose()
            await announcer.aclose()

    asyncio.run(scenario())


def test_each_role_can_do_no_more_than_its_acl_allows(server: PrivateRedis) -> None:
    worker = redis.Redis.from_url(role_url(server, "rollout.env"), socket_timeout=5)
    registry = redis.Redis.from_url(role_url(server, "registry.env"), socket_timeout=5)
    with worker, registry:
        for denied in (lambda: worker.flushall(), lambda: worker.config_get("*"), lambda: worker.keys("*"),
                       lambda: worker.set("other-app:key", 1)):
            with pytest.raises(redis.exceptions.NoPermissionError):
                denied()
        with pytest.raises(redis.exceptions.NoPermissionError):
            registry.xrange(f"{PREFIX}:{RUN}:prompts")  # the registry never reads the queues
        with pytest.raises(redis.exceptions.NoPermissionError):
            registry.set(f"{PREFIX}:{RUN}:trainer-version", 99)
        assert registry.ping()
