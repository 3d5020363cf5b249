"""Bad input never stalls or breaks a run, over real HTTP with a real Redis: oversized and
unscorable prompts, malformed text, object keys and uploads, and anonymous plans that must not
build merged patches (docs/coordination.md, "Bad input")."""

from __future__ import annotations

import asyncio
import json
import select
import socket
import time
from collections.abc import Iterator
from pathlib import Path

import httpx
import pytest
import redis

from services.registry.app import create_app as create_registry
from services.registry.settings import RegistrySettings
from services.rollout.app import create_app as create_rollout
from services.rollout.settings import RolloutSettings
from services.trainer.app import create_app as create_trainer
from services.trainer.settings import TrainerSettings
from shared.coord import CoordSettings
from shared.kv import KVSettings
from shared.patch import extract_patch, save_snapshot
from shared.registry.client import RegistryClient
from tests.conftest import REDIS_URL, serve_app
from tests.integration.registry_helpers import TOKEN, make_chain, tiny_state
from tests.integration.trainer.test_trainer_service import wait_ready

AUTH = {"Authorization": f"Bearer {TOKEN}"}
NDJSON = {"content-type": "application/x-ndjson"}


@pytest.fixture(scope="module")
def stack(tmp_path_factory: pytest.TempPathFactory, tiny_model_dir: str) -> Iterator[dict[str, str]]:
    """Registry + trainer (default request limits) + a standalone rollout worker, one Redis prefix."""
    tmp = tmp_path_factory.mktemp("faults-input")
    prefix = f"test:faults-input-{time.time_ns()}"
    reg = RegistrySettings(store_url=f"file://{tmp / 'store'}", api_token=TOKEN)
    rollout = RolloutSettings(model=tiny_model_dir, device="cpu", kv=KVSettings(policy="dense"), max_batch=4,
                              max_new_tokens_limit=16, redis_url="", registry_url="")
    with serve_app(create_registry(reg)) as registry_url:
        settings = TrainerSettings(model=tiny_model_dir, device="cpu", data_dir=str(tmp / "trainer"), run="t",
                                   api_token=TOKEN, registry_url=registry_url, redis_url=REDIS_URL,
                                   redis_prefix=prefix, coord=CoordSettings(max_queue=50))
        with (
            serve_app(create_trainer(settings)) as trainer_url,
            serve_app(create_rollout(rollout)) as rollout_url,
        ):
            wait_ready(trainer_url)
            yield {"trainer": trainer_url, "registry": registry_url, "rollout": rollout_url, "prefix": prefix,
                   "store": str(tmp / "store")}
    client = redis.Redis.from_url(REDIS_URL)
    keys = list(client.scan_iter(match=f"{prefix}*"))
    if keys:
        client.delete(*keys)
    client.close()


def nothing_reached_redis(stack: dict[str, str]) -> None:
    """No prompt was queued and no key of the run holds more than a few KB (dead letters included)."""
    queue = httpx.get(f"{stack['trainer']}/v1/status").json()["queue"]
    assert queue["enqueued"] == 0 and queue["dead_letter_depth"] == 0, queue
    client = redis.Redis.from_url(REDIS_URL)
    try:
        for key in client.scan_iter(match=f"{stack['prefix']}*"):  # whatever the key layout
            assert (client.memory_usage(key) or 0) < 64 << 10, key
    finally:
        client.close()


# -- row 5: size limits and answers the task cannot score --


@pytest.mark.parametrize(
    ("prompt", "status", "needle"),
    [
        ({"prompt": "add 1+2\n" + "9" * (10 << 20), "answer": "3"}, 422, "prompt has 10485768 characters"),
        (
            {"prompt": "add 1+2\n", "answer": "3", "metadata": {"blob": "x" * (20 << 20)}},
            422,
            "metadata is 20971",
        ),
        ({"prompt": "add 1+2\n", "answer": "3" * 5000}, 422, "answer has 5000 characters"),
        ({"prompt": "add 1+2\n", "answer": "3", "metadata": {"k": "é" * 9000}}, 422, "metadata is 18"),
    ],
    ids=["10MB_prompt", "20MB_metadata", "long_answer", "metadata_counted_in_utf8"],
)
def test_row5_oversized_prompts_are_refused_before_redis(stack: dict[str, str], prompt: dict, status: int,
                                                         needle: str) -> None:
    r = httpx.post(
        f"{stack['trainer']}/v1/prompts",
        json={"task": "addition", "prompts": [prompt]},
        headers=AUTH,
        timeout=60,
    )
    assert r.status_code == status, r.text[:300]
    assert needle in r.json()["detail"] and len(r.text) < 1000  # the payload is not echoed back
    nothing_reached_redis(stack)


def test_row5_request_bodies_are_capped_by_length_and_while_streaming(stack: dict[str, str]) -> None:
    line = b'{"prompt": "add 1+2\\n", "answer": "3", "metadata": {"pad": "' + b"x" * 60_000 + b'"}}\n'
    headers = {"Authorization": f"Bearer {TOKEN}", "Content-Type": "application/x-ndjson"}
    path = "/v1/prompts?task=addition"
    # 36 MB declared: over the 32 MiB default, refused before a byte of the body is read.
    status, body, _ = raw_request(stack["trainer"], "POST", path, headers, b"", 36 << 20, 36 << 20, line)
    assert status == 413 and "exceeds the limit" in json.loads(body)["detail"], body
    # No Content-Length (chunked): refused once the cap is passed, not after the whole body.
    status, body, sent = raw_request(stack["trainer"], "POST", path, headers, b"", None, 200 << 20, line)
    assert status == 413 and "exceeds the limit" in json.loads(body)["detail"], body
    assert (32 << 20) < sent < (48 << 20)
    nothing_reached_redis(stack)


@pytest.mark.parametrize(
    ("task", "prompt", "needle"),
    [
        ("countdown", {"prompt": "countdown 3 7 25 to 46\n", "answer": "46"}, "3 7 25 -> 46"),
        ("countdown", {"prompt": "countdown 3 7 25 to 46\n"}, "3 7 25 -> 46"),
        ("addition", {"prompt": "add 1+2\n", "answer": "three"}, "sum's digits"),
        ("addition", {"prompt": "add 1+2\n"}, "sum's digits"),
        ("sorting", {"prompt": "sort 3 1\n", "answer": "1,3"}, "single spaces"),
        ("gsm8k", {"prompt": "Question: q\nAnswer:", "answer": "none"}, "holds a number"),
    ],
)
def test_row5_answers_the_task_cannot_score_are_422(stack: dict[str, str], task: str, prompt: dict,
                                                    needle: str) -> None:
    # One good prompt beside the bad one: the request is refused whole, nothing is half-queued.
    good = {"countdown": ("countdown 3 7 25 to 46\n", "3 7 25 -> 46"), "addition": ("add 1+2\n", "3"),
            "sorting": ("sort 3 1\n", "1 3"), "gsm8k": ("Question: q\nAnswer:", "4")}[task]
    body = {"task": task, "prompts": [{"prompt": good[0], "answer": good[1]}, prompt]}
    r = httpx.post(f"{stack['trainer']}/v1/prompts", json=body, headers=AUTH)
    assert (
        r.status_code == 422 and r.json()["detail"].startswith("prompt 1: ") and needle in r.json()["detail"]
    )
    ndjson = "\n".join(json.dumps(p) for p in body["prompts"])
    r = httpx.post(f"{stack['trainer']}/v1/prompts?task={task}", content=ndjson, headers=AUTH | NDJSON)
    assert r.status_code == 422 and needle in r.json()["detail"]
    nothing_reached_redis(stack)


# -- row 6: malformed text and keys get a clear 4xx, never a 500 --


def test_row6_invalid_utf8_and_lone_surrogates_in_prompt_uploads(stack: dict[str, str]) -> None:
    url = f"{stack['trainer']}/v1/prompts?task=addition"
    cases = [
        (
            b'{"prompt": "add 1+2\\n", "answer": "3"}\n{"prompt": "add \xff\xfe", "answer": "3"}\n',
            NDJSON,
            "line 2: not UTF-8",
        ),
        (b'{"prompt": "add 1+2\\n\xc3", "answer": "3"}', NDJSON, "line 1: not UTF-8"),
        (b'{"prompt": "add \\ud800\\n", "answer": "3"}', NDJSON, "unicode"),
        (
            b'{"prompt": "add 1+2\\n", "answer": "3", "metadata": {"k": "\\udfff"}}',
            NDJSON,
            "metadata is not UTF-8",
        ),
        (
            b'{"prompts": [{"prompt": "add \\ud83d\\n", "answer": "3"}]}',
            {"content-type": "application/json"},
            "body",
        ),
        (
            b'{"prompts": [{"prompt": "add \xff\\n", "answer": "3"}]}',
            {"content-type": "application/json"},
            "body",
        ),
        (b"[" * 100_000, NDJSON, "line 1"),
    ]
    for body, headers, needle in cases:
        r = httpx.post(url, content=body, headers=AUTH | headers)
        assert r.status_code == 422, (body[:60], r.status_code, r.text[:200])
        assert needle.lower() in r.json()["detail"].lower(), (body[:60], r.json())
    r = httpx.post(
        url,
        files={"file": ("p.jsonl", b'{"prompt": "\xe2\x82", "answer": "3"}', "application/x-ndjson")},
        headers=AUTH,
    )
    assert r.status_code == 422 and "not UTF-8" in r.json()["detail"]
    nothing_reached_redis(stack)


@pytest.mark.parametrize("path", ["/v1/generate", "/v1/completions"])
def test_row6_lone_surrogates_at_the_rollout_service(stack: dict[str, str], path: str) -> None:
    body = {"/v1/generate": b'{"prompts": ["12+\\ud800"], "max_tokens": 4}',
            "/v1/completions": b'{"prompt": "12+\\udc00", "max_tokens": 4}'}[path]
    r = httpx.post(f"{stack['rollout']}{path}", content=body, headers={"content-type": "application/json"})
    assert r.status_code == 422 and "unicode" in r.json()["detail"].lower(), r.text
    stop = b'{"prompt": "12+", "max_tokens": 4, "stop": ["\\ud800"]}'
    if path == "/v1/completions":
        r = httpx.post(
            f"{stack['rollout']}{path}", content=stop, headers={"content-type": "application/json"}
        )
        assert r.status_code == 422, r.text
    ok = {
        "/v1/generate": {"prompts": ["12+"], "max_tokens": 2},
        "/v1/completions": {"prompt": "12+", "max_tokens": 2},
    }
    assert httpx.post(f"{stack['rollout']}{path}", json=ok[path], timeout=60).status_code == 200


@pytest.mark.parametrize(
    "key",
    [
        "patches/%00",
        "patches/a%00b.patch",
        "model/%0A",
        "merged/%C3%A9",
        "patches/%FF",
        "snapshots/%2e%2e",
        "patches/a%2Fb",
    ],
)
def test_row6_odd_object_keys_are_a_clear_422(stack: dict[str, str], key: str) -> None:
    r = httpx.get(f"{stack['registry']}/v1/runs/r/objects/{key}")
    assert r.status_code == 422 and "bad object key" in r.json()["detail"], r.text


# -- the registry checks uploads while they stream in --


def complete(response: bytes) -> bool:
    """A whole HTTP response: headers, then Content-Length bytes or the last chunk."""
    head, sep, body = response.partition(b"\r\n\r\n")
    if not sep:
        return False
    for line in head.lower().split(b"\r\n"):
        if line.startswith(b"content-length:"):
            return len(body) >= int(line.split(b":")[1])
    return body.endswith(b"0\r\n\r\n")


def raw_request(url: str, method: str, path: str, headers: dict[str, str], head: bytes, declared: int | None,
                send_bytes: int, filler: bytes = bytes(65536)) -> tuple[int, str, int]:
    """A request whose body is `head` then `filler` repeated, sent until `send_bytes` or until the
    server answers, with a Content-Length of `declared` (None: chunked transfer encoding).
    Returns (status, body, body bytes sent before the answer)."""
    host, port = url.removeprefix("http://").split(":")
    sock = socket.create_connection((host, int(port)), timeout=30)
    framing = f"Content-Length: {declared}" if declared is not None else "Transfer-Encoding: chunked"
    lines = "".join(f"{k}: {v}\r\n" for k, v in headers.items())
    sock.sendall(f"{method} {path} HTTP/1.1\r\nHost: {host}\r\n{lines}{framing}\r\n\r\n".encode())
    sent, response, pending = 0, b"", head
    try:
        while sent < send_bytes and not response:
            piece, pending = (pending or filler), b""
            frame = piece if declared is not None else b"%x\r\n%b\r\n" % (len(piece), piece)
            try:
                sock.sendall(frame)
                sent += len(piece)
            except (BrokenPipeError, ConnectionResetError):
                break  # the server answered and closed; its answer is read below
            if select.select([sock], [], [], 0)[0]:
                response += sock.recv(65536)
        while not complete(response):
            try:
                chunk = sock.recv(65536)
            except ConnectionResetError:
                break
            if not chunk:
                break
            response += chunk
    finally:
        sock.close()
    status = int(response.split(b" ", 2)[1])
    body = response.split(b"\r\n\r\n", 1)[1]
    if b"chunked" in response.split(b"\r\n\r\n", 1)[0].lower():  # de-frame a chunked answer
        body = body.split(b"\r\n", 1)[1].rsplit(b"\r\n0\r\n", 1)[0]
    return status, body.decode(errors="replace"), sent


def raw_put(url: str, path: str, head: bytes, declared: int | None, send_bytes: int) -> tuple[int, str, int]:
    return raw_request(
        url,
        "PUT",
        path,
        {"Authorization": f"Bearer {TOKEN}", "Content-Type": "application/octet-stream"},
        head,
        declared,
        send_bytes,
    )


def test_registry_refuses_a_300MB_junk_upload_after_its_first_bytes(stack: dict[str, str]) -> None:
    base = stack["registry"]
    junk = 300 << 20
    chain = make_chain("r", 1)
    cases = [
        ("/v1/runs/r/patches/1", b"GARBAGE!", junk, "bad magic"),
        (
            "/v1/runs/r/patches/1",
            chain.patches[1][:12] + b"\xff\xff\xff\x7f",
            junk,
            "exceeds the format's cap",
        ),
        ("/v1/runs/r/patches/1", b"GARBAGE!", None, "bad magic"),  # chunked: no length declared
        ("/v1/runs/r/snapshots/0", b"\xff" * 8 + b"{", junk, "exceeds"),
        ("/v1/runs/r/snapshots/0", b"\x10" + bytes(7) + b"GARBAGE", junk, "not a safetensors file"),
        (
            "/v1/runs/r/model/config.json",
            b"\x89PNG\r\n",
            60 << 20,
            "JSON object",
        ),  # model files: 64 MiB at most
    ]
    for path, head, declared, needle in cases:
        t0 = time.monotonic()
        status, body, sent = raw_put(base, path, head, declared, junk)
        assert status == 422 and needle in json.loads(body)["detail"], (path, status, body)
        assert sent <= 8 << 20, f"{path}: {sent} bytes went in before the refusal"
        assert time.monotonic() - t0 < 30
    # A well-formed prefix and header whose body runs past the length the header declares.
    patch = chain.patches[1]
    status, body, sent = raw_put(base, "/v1/runs/r/patches/1", patch, junk, junk)
    assert status == 422 and "Content-Length" in json.loads(body)["detail"] and sent <= 8 << 20
    snapshot = save_snapshot(tiny_state(), run="r", version=0)
    status, body, _ = raw_put(base, "/v1/runs/r/snapshots/0", snapshot, junk, junk)
    assert status == 422 and "Content-Length" in json.loads(body)["detail"]
    r = httpx.put(f"{base}/v1/runs/r/patches/1", content=iter([patch, b"\0" * 100]), headers=AUTH)  # chunked
    assert r.status_code == 422 and "longer than" in r.json()["detail"]
    # Over the size limit, declared or streamed.
    status, body, _ = raw_put(base, "/v1/runs/r/model/config.json", b"{", junk, 1)
    assert status == 413 and "exceeds the limit" in json.loads(body)["detail"]
    status, body, sent = raw_put(base, "/v1/runs/r/model/config.json", b"{", None, junk)
    assert status == 413 and (64 << 20) < sent < (80 << 20)


# -- row 7: reads never write; plan work is bounded --


def stored(store: str, run: str) -> set[str]:
    root = Path(store) / run
    return {str(p.relative_to(root)) for p in root.rglob("*") if p.is_file()} if root.exists() else set()


async def test_row7_anonymous_plans_create_no_objects(stack: dict[str, str]) -> None:
    base, store = stack["registry"], stack["store"]
    chain = make_chain("plans", 6, seed=5)
    async with RegistryClient(base, "plans", token=TOKEN) as writer:
        await writer.publish_snapshot(0, chain.snapshot(0))
        for v in range(1, 5):
            await writer.publish_patch(v, chain.patches[v])
    before = stored(store, "plans")
    async with httpx.AsyncClient(base_url=f"{base}/v1/runs/plans") as http:
        for a in (-1, 0, 1, 2):
            for _ in range(3):
                r = await http.get("/plan", params={"from": a, "to": 4})
                assert r.status_code == 200 and r.json()["kind"] in ("chain", "snapshot"), r.text
        assert stored(store, "plans") == before  # no merged patch, no index, nothing
        r = await http.get("/plan", params={"from": 1}, headers={"Authorization": "Bearer wrong"})
        assert r.status_code == 200 and r.json()["kind"] == "chain" and stored(store, "plans") == before
        # The next publish builds what those plans wanted, ending at the new head: lags 4, 3, 2
        # (from versions 0, 1, 2) and the snapshot → head merge that fresh workers would use.
        async with RegistryClient(base, "plans", token=TOKEN) as writer:
            await writer.publish_patch(5, chain.patches[5])
        wanted = {"merged/1-5.patch", "merged/2-5.patch", "merged/3-5.patch", "merged/0-5.patch"}
        deadline = time.monotonic() + 60
        while not wanted <= stored(store, "plans") and time.monotonic() < deadline:
            await asyncio.sleep(0.1)
        assert wanted <= stored(store, "plans")
        r = await http.get("/plan", params={"from": 2})
        assert r.json()["kind"] == "merged" and r.json()["steps"][0]["object"]["key"] == "merged/2-5.patch"
        # Only an authorised plan has a merge no publish made built at once.
        assert "merged/1-3.patch" not in stored(store, "plans")
        r = await http.get("/plan", params={"from": 1, "to": 3}, headers=AUTH)
        assert r.status_code == 200 and "merged/1-3.patch" in stored(store, "plans")


async def test_row7_plan_work_is_bounded_by_what_is_stored(stack: dict[str, str]) -> None:
    # A run resumed at a high step: an anonymous plan from version 0 must not walk 10**12 versions.
    base = stack["registry"]
    state = tiny_state(9)
    high = 10**12
    async with RegistryClient(base, "far", token=TOKEN) as writer:
        await writer.publish_snapshot(high, save_snapshot(state, run="far", version=high))
        nxt = {k: v.clone() for k, v in state.items()}
        nxt["model.norm.weight"][0] += 1
        await writer.publish_patch(high + 1, extract_patch(state, nxt, run="far", base_version=high,
                                                           target_version=high + 1))
    async with httpx.AsyncClient(base_url=f"{base}/v1/runs/far", timeout=10) as http:
        t0 = time.monotonic()
        for a in (0, 5, high - 40, high - 1):
            r = await http.get("/plan", params={"from": a})
            assert r.status_code == 200 and r.json()["kind"] == "snapshot", r.text
        assert time.monotonic() - t0 < 5
        assert (await http.get(f"{base}/healthz")).status_code == 200
