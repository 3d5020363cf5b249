"""Container health probe: GET http://127.0.0.1:$SPARSECAST_PORT<path>, exit 0 on 2xx, 1 otherwise.

Used by the images' HEALTHCHECK and by compose.yaml. Standard library only: the slim images carry
no curl or wget, and one image serves all three services, so the port comes from the environment.

    python /opt/sparsecast/healthcheck.py            # /healthz (process up)
    python /opt/sparsecast/healthcheck.py /readyz    # dependencies reachable, model loaded
"""

from __future__ import annotations

import os
import sys
import urllib.error
import urllib.request

DEFAULT_PORT = 8000  # the trainer's; compose and the chart always set SPARSECAST_PORT


def probe(path: str = "/healthz", port: int | None = None, timeout: float = 4.0) -> bool:
    port = port if port is not None else int(os.environ.get("SPARSECAST_PORT", DEFAULT_PORT))
    url = f"http://127.0.0.1:{port}{path}"
    try:
        with urllib.request.urlopen(url, timeout=timeout) as response:
            return 200 <= response.status < 300
    except (urllib.error.URLError, OSError, ValueError):
        # URLError covers HTTP 4xx/5xx (HTTPError) and refused connections alike.
        return False


def main(argv: list[str]) -> int:
    path = argv[1] if len(argv) > 1 else "/healthz"
    return 0 if probe(path) else 1


if __name__ == "__main__":
    sys.exit(main(sys.argv))
