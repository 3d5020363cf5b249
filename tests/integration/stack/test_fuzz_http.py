"""No 500 for any input: a bounded schemathesis run against the OpenAPI documents of the three
services (trainer, registry, rollout), each a real uvicorn server on loopback with a real Redis.

Every operation gets `EXAMPLES` generated requests (valid and invalid: wrong types, missing and
extra fields, odd strings, random bytes for uploads), sent with the bearer token so that the
fuzzer gets past authentication. Each answer must not be a 5xx, must carry a status code and a
body that the document describes, and every 4xx must carry the string `detail` the document
promises. A few minutes of two cores in all.
"""

from __future__ import annotations

import time
from collections import Counter
from collections.abc import Iterator

import httpx
import pytest
import redis
import schemathesis
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st
from schemathesis import GenerationMode, checks

from services.registry.app import create_app as create_registry
from services.registry.settings import RegistrySettings
from services.rollout.app import create_app as create_rollout
from services.rollout.settings import RolloutSettings
from services.trainer.app import create_app as create_trainer
from services.trainer.settings import TrainerSettings
from shared.coord import CoordSettings
from shared.kv import KVSettings
from tests.conftest import REDIS_URL, serve_app
from tests.integration.trainer.test_trainer_service import wait_ready

TOKEN = "fuzz-token"
AUTH = {"Authorization": f"Bearer {TOKEN}"}
EXAMPLES = 100


@pytest.fixture(scope="module")
def servers(tmp_path_factory: pytest.TempPathFactory, tiny_model_dir: str) -> Iterator[dict[str, str]]:
    tmp = tmp_path_factory.mktemp("fuzz")
    prefix = f"test:fuzz-{time.time_ns()}"
    registry = RegistrySettings(
        store_url=f"file://{tmp / 'store'}", api_token=TOKEN, max_upload_bytes=1 << 20
    )
    rollout = RolloutSettings(model=tiny_model_dir, device="cpu", kv=KVSettings(policy="dense"), max_batch=4,
                              max_new_tokens_limit=8, api_token=TOKEN, redis_url="", registry_url="")
    with serve_app(create_registry(registry)) as registry_url:
        trainer = TrainerSettings(
            model=tiny_model_dir,
            device="cpu",
            data_dir=str(tmp / "trainer"),
            run="fuzz",
            api_token=TOKEN,
            registry_url=registry_url,
            redis_url=REDIS_URL,
            redis_prefix=prefix,
            coord=CoordSettings(max_queue=25_000),
            checkpoint_every=0,
        )
        with (
            serve_app(create_trainer(trainer)) as trainer_url,
            serve_app(create_rollout(rollout)) as rollout_url,
        ):
            wait_ready(trainer_url)
            yield {"trainer": trainer_url, "registry": registry_url, "rollout": rollout_url}
    client = redis.Redis.from_url(REDIS_URL)
    keys = list(client.scan_iter(match=f"{prefix}*"))
    if keys:
        client.delete(*keys)
    client.close()


@schemathesis.check
def detail_is_a_string(ctx, response, case) -> bool | None:
    """Every error answer carries {"detail": "<text>"} (shared.http.ErrorBody)."""
    if response.status_code >= 400 and response.headers.get("content-type", [""])[0].startswith(
        "application/json"
    ):
        body = response.json()
        assert isinstance(body, dict) and isinstance(body.get("detail"), str) and body["detail"], (
            f"{response.status_code} without a string detail: {body!r}")
    return None


CHECKS = [checks.not_a_server_error, checks.status_code_conformance, checks.content_type_conformance,
          checks.response_schema_conformance, detail_is_a_string]
FUZZ = settings(max_examples=EXAMPLES, deadline=None, derandomize=True, database=None,
                suppress_health_check=list(HealthCheck))


def fuzz(url: str) -> Counter[tuple[str, int]]:
    """Every operation of the service's OpenAPI document, valid and invalid requests alike; returns
    how often each (operation, status) was answered. (schemathesis' pytest plugin needs pytest
    internals that pytest 9 removed: plain Hypothesis over its strategies instead.)"""
    schema = schemathesis.openapi.from_url(f"{url}/openapi.json")
    answered: Counter[tuple[str, int]] = Counter()
    failures = []
    for result in schema.get_all_operations():
        operation = result.ok()
        cases = st.one_of(operation.as_strategy(generation_mode=GenerationMode.POSITIVE),
                          operation.as_strategy(generation_mode=GenerationMode.NEGATIVE))

        @FUZZ
        @given(case=cases)
        def run(case) -> None:
            response = case.call_and_validate(headers=AUTH, checks=CHECKS, timeout=60)
            answered[(case.operation.label, response.status_code)] += 1

        try:
            run()
        except (Exception, BaseExceptionGroup) as exc:  # noqa: BLE001 - collect every operation's failures
            failures.append(f"{operation.label}: {type(exc).__name__}: {str(exc)[:3000]}")
    assert not failures, "\n\n".join(failures)
    return answered


# Per service, an operation the fuzzer must get through with a 2xx at least once, or it would
# only be exercising authentication and validation.
REACHED = {"registry": "PUT /v1/runs/{run}/model/{name}", "rollout": "POST /v1/completions",
           "trainer": "POST /v1/prompts"}


@pytest.mark.parametrize("service", ["registry", "rollout", "trainer"])
def test_every_input_gets_an_answer_the_document_describes(servers: dict[str, str], service: str) -> None:
    answered = fuzz(servers[service])
    assert sum(answered.values()) >= 150, answered
    assert any(label == REACHED[service] and 200 <= status < 300 for label, status in answered), answered


def test_the_documents_describe_bodies_and_errors(servers: dict[str, str]) -> None:
    docs = {name: httpx.get(f"{url}/openapi.json").json() for name, url in servers.items()}
    prompts = docs["trainer"]["paths"]["/v1/prompts"]["post"]
    assert set(prompts["requestBody"]["content"]) == {
        "application/json",
        "application/x-ndjson",
        "multipart/form-data",
    }
    assert "prompts" in prompts["requestBody"]["content"]["application/json"]["schema"]["properties"]
    for path in ("/v1/runs/{run}/patches/{version}", "/v1/runs/{run}/snapshots/{version}"):
        put = docs["registry"]["paths"][path]["put"]
        assert put["requestBody"]["content"]["application/octet-stream"]["schema"]["format"] == "binary"
        assert {"401", "409", "413", "422"} <= set(put["responses"])
    for name, doc in docs.items():
        error = doc["components"]["schemas"]["ErrorBody"]
        assert error["properties"]["detail"]["type"] == "string", name
        for path, operations in doc["paths"].items():
            for method, op in operations.items():
                for code, response in op["responses"].items():
                    if code.startswith("4") and "content" in response:
                        ref = response["content"]["application/json"]["schema"]["$ref"]
                        assert ref.endswith("/ErrorBody"), (name, method, path, code)
        assert "HTTPValidationError" not in doc["components"]["schemas"], name
