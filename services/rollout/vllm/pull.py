"""Tell a stock `vllm serve` (with the sparsecast plugins) to pull weights from the registry.

    python -m services.rollout.vllm.pull --vllm-url http://127.0.0.1:8000 \\
        --registry-url http://registry:8100 --run demo [--version 7 | --follow]

One pull (a version, or the head) prints the server's answer as JSON; `--follow` is a sidecar: it
pulls the head, waits for the next version (the registry's Redis announcements with --redis-url,
polling otherwise) and pulls again, forever, waiting out a registry or vLLM server that goes away.
A version whose pull fails (the server still serves a verified earlier one) is skipped: the next
published version is pulled. docs/vllm.md, "Stock `vllm serve` with the registry as weight source".
Exit status: 0 ok, 1 the server or registry refused or failed, 2 bad usage.
"""

from __future__ import annotations

import argparse
import asyncio
import functools
import json
import logging
import os
import sys
from typing import Any

import httpx

from services.rollout.vllm.plugin import BACKEND, PULL_PATH
from shared.registry.client import RegistryClient
from shared.retry import Outage
from shared.schemas import DEFAULT_RUN

log = logging.getLogger("sparsecast.vllm_pull")
EXIT_OK, EXIT_ERROR, EXIT_USAGE = 0, 1, 2
# A wait for the next version returns at least this often (then waits again).
VERSION_WAIT_S = 30.0
BACKEND_CONFIG = json.dumps({"backend": BACKEND})


class PullRefused(Exception):
    """The server answered the pull with an error that waiting will not fix (4xx, or a failed pull)."""

    def __init__(self, status: int, answer: dict[str, Any]) -> None:
        super().__init__(f"{status}: {answer.get('detail', answer)}")
        self.status, self.answer = status, answer


async def pull(http: httpx.AsyncClient, body: dict[str, Any]) -> dict[str, Any]:
    """One pull; raises ConnectionError while the server (or its registry) is unreachable."""
    try:
        response = await http.post(PULL_PATH, json=body)
    except httpx.TransportError as exc:
        raise ConnectionError(f"vLLM server {http.base_url} unreachable: {exc}") from exc
    try:
        answer = response.json()
    except ValueError:
        answer = {"detail": response.text}
    if response.status_code == 503:
        raise ConnectionError(answer.get("detail", "unavailable"))
    if response.status_code == 404 and "detail" not in answer:
        raise PullRefused(404, {"detail": f"no {PULL_PATH} route: start vllm serve with VLLM_PLUGINS="
                                          f"sparsecast and --weight-transfer-config '{BACKEND_CONFIG}'"})
    if response.status_code == 401:
        raise PullRefused(401, {"detail": "the vLLM server wants its API key: pass --api-key or set "
                                          "VLLM_API_KEY to the key vllm serve runs with"})
    if response.status_code >= 400:
        raise PullRefused(response.status_code, answer)
    return answer


async def follow(http: httpx.AsyncClient, registry: RegistryClient, body: dict[str, Any]) -> None:
    server, source = Outage("vLLM server", log), Outage("registry", log)
    seen = -1  # the newest version pulled, or skipped because its pull failed
    while True:
        try:
            answer = await server.call(lambda: pull(http, body))
            seen = answer["version"]
            if answer.get("pulled"):
                log.info("serving v%d (%s)", seen, json.dumps(answer))
        except PullRefused as exc:
            if exc.status in (401, 404, 409, 422) and seen < 0:
                raise  # misconfigured from the start: say so and stop
            log.error("pull refused (%s); waiting for the next version", exc)
            if exc.status == 502:  # the head failed to apply (the server keeps a verified version)
                head = await source.call(registry.latest)
                seen = max(seen, head.version if head is not None else -1)
        version = await source.call(
            functools.partial(registry.wait_for_version, seen, timeout=VERSION_WAIT_S))
        if version is not None:
            log.info("v%d published", version)
        # None: nothing new yet; pulling the head again is a cheap no-op


def build_parser() -> argparse.ArgumentParser:
    env = os.environ.get
    parser = argparse.ArgumentParser(
        prog="python -m services.rollout.vllm.pull",
        description="Make a stock `vllm serve` (with the sparsecast plugins) pull a version of a run "
                    "from the registry, once or following the run's head.",
        epilog="Exit status: 0 ok, 1 the server or registry refused or failed, 2 bad usage. "
               "See docs/vllm.md.")
    parser.add_argument("--vllm-url", default=env("SPARSECAST_VLLM_URL", "http://127.0.0.1:8000"),
                        help="the vllm serve address (env SPARSECAST_VLLM_URL; default %(default)s)")
    parser.add_argument("--api-key", default=env("VLLM_API_KEY") or None,
                        help="vllm serve's --api-key (env VLLM_API_KEY)")
    parser.add_argument("--registry-url", default=env("SPARSECAST_REGISTRY_URL") or None,
                        help="the registry (env SPARSECAST_REGISTRY_URL; unset: the server's own)")
    parser.add_argument("--run", default=env("SPARSECAST_RUN", DEFAULT_RUN),
                        help="run name at the registry (env SPARSECAST_RUN; default %(default)s)")
    parser.add_argument("--registry-token", default=env("SPARSECAST_REGISTRY_TOKEN") or None,
                        help="registry token, passed on to the server (env SPARSECAST_REGISTRY_TOKEN)")
    parser.add_argument("--redis-url", default=env("SPARSECAST_REDIS_URL") or None,
                        help="hear new versions from the registry's Redis announcements (--follow)")
    parser.add_argument("--mode", choices=("wait", "abort"), default="wait",
                        help="in-flight requests finish on the old weights (wait) or are cut off (abort)")
    target = parser.add_mutually_exclusive_group()
    target.add_argument("--version", type=int, help="pull this version (default: the head)")
    target.add_argument("--follow", action="store_true", help="keep pulling each new version (a sidecar)")
    parser.add_argument("--timeout", type=float, default=600.0,
                        help="seconds one pull may take, draining included (default %(default)s)")
    return parser


async def amain(args: argparse.Namespace) -> int:
    body: dict[str, Any] = {"version": args.version, "mode": args.mode, "run": args.run,
                            "registry_url": args.registry_url, "token": args.registry_token}
    headers = {"Authorization": f"Bearer {args.api_key}"} if args.api_key else {}
    async with httpx.AsyncClient(base_url=args.vllm_url, headers=headers, timeout=args.timeout) as http:
        if not args.follow:
            print(json.dumps(await pull(http, body), sort_keys=True))
            return EXIT_OK
        async with RegistryClient(args.registry_url, args.run, token=args.registry_token,
                                  redis_url=args.redis_url) as registry:
            await follow(http, registry, body)
    return EXIT_OK


def main(argv: list[str] | None = None) -> int:
    parser = build_parser()
    try:
        args = parser.parse_args(argv)
    except SystemExit as exc:  # argparse: --help exits 0, bad usage 2
        return int(exc.code or 0)
    if args.follow and not args.registry_url:
        parser.print_usage(sys.stderr)
        print("error: --follow needs --registry-url (or SPARSECAST_REGISTRY_URL) to hear new versions",
              file=sys.stderr)
        return EXIT_USAGE
    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(levelname)s %(name)s: %(message)s")
    try:
        return asyncio.run(amain(args))
    except (PullRefused, ConnectionError) as exc:
        print(f"error: {exc}", file=sys.stderr)
        return EXIT_ERROR
    except KeyboardInterrupt:
        return 130


if __name__ == "__main__":
    sys.exit(main())
