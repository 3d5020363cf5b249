"""Issue 13, row 8: secure defaults. Every service listens on loopback unless told otherwise, and a
non-loopback bind without an API token refuses to start with a clear message (real processes)."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest

from services.registry.settings import RegistrySettings
from services.rollout.settings import RolloutSettings
from services.trainer.settings import TrainerSettings
from shared.http import InsecureBind, is_loopback, require_token_off_loopback
from tests.paths import REPO_ROOT

ROOT = REPO_ROOT


def clean_env(**extra: str) -> dict[str, str]:
    env = {k: v for k, v in os.environ.items() if not k.startswith("SPARSECAST_")}
    return env | {"PYTHONPATH": str(ROOT), "OMP_NUM_THREADS": "1"} | extra


def test_every_service_binds_loopback_by_default() -> None:
    env = clean_env()
    for settings in (RegistrySettings, TrainerSettings, RolloutSettings):
        code = f"from {settings.__module__} import {settings.__name__} as S; print(S().host)"
        out = subprocess.run(
            [sys.executable, "-c", code], env=env, cwd=ROOT, capture_output=True, text=True, timeout=120
        )
        assert out.stdout.strip() == "127.0.0.1", (settings.__name__, out.stderr[-500:])


@pytest.mark.parametrize(
    ("service", "host"), [("registry", "0.0.0.0"), ("trainer", "0.0.0.0"), ("rollout", "::")]
)
def test_a_public_bind_without_a_token_refuses_to_start(service: str, host: str, tmp_path: Path) -> None:
    # Port 9 (discard) would need root on most hosts anyway: the check runs before any bind.
    env = clean_env(SPARSECAST_HOST=host, SPARSECAST_PORT="9", SPARSECAST_DATA_DIR=str(tmp_path),
                    SPARSECAST_STORE_URL=f"file://{tmp_path}/store")
    try:
        done = subprocess.run([sys.executable, "-m", f"services.{service}"], env=env, cwd=tmp_path,
                              capture_output=True, text=True, timeout=180)
    except subprocess.TimeoutExpired:
        pytest.fail(f"{service} kept running on {host} without a token")
    assert done.returncode != 0
    assert f"refusing to listen on {host} without an API token" in done.stderr, done.stderr[-2000:]
    assert "SPARSECAST_API_TOKEN" in done.stderr
    assert not (tmp_path / "api-token").exists()  # the trainer did not generate one instead


def test_the_bind_rule() -> None:
    for host in ("127.0.0.1", "127.0.0.53", "::1", "[::1]", "localhost"):
        assert is_loopback(host)
        require_token_off_loopback("registry", host, None)
    for host in ("0.0.0.0", "::", "10.0.0.5", "192.168.1.2", "example.org", ""):
        assert not is_loopback(host)
        with pytest.raises(InsecureBind, match="SPARSECAST_API_TOKEN"):
            require_token_off_loopback("registry", host, None)
        with pytest.raises(InsecureBind):
            require_token_off_loopback("trainer", host, "")
        require_token_off_loopback("registry", host, "a-token")  # with a token: allowed
