"""A redis-server of a test's own, for faults that must never touch the shared Redis: killing its
clients, restarting it (with its AOF), or losing its data. Port and data folder are the test's;
`close()` stops it whatever happened (use it as a context manager)."""

from __future__ import annotations

import shutil
import subprocess
import time
from collections.abc import Sequence
from pathlib import Path

import redis

from shared.ports import free_port

STARTUP_TIMEOUT_S = 20.0


class PrivateRedis:
    def __init__(self, data_dir: Path, *, appendonly: bool = True, args: Sequence[str] = (),
                 auth: tuple[str, str] | None = None) -> None:
        """`args`: more redis-server options (e.g. ACL users); `auth`: the (user, password) this
        object's own client logs in with, when `args` turn anonymous access off."""
        if shutil.which("redis-server") is None:
            raise RuntimeError("redis-server is not installed; fault tests start a private one")
        self.dir = data_dir
        self.dir.mkdir(parents=True, exist_ok=True)
        self.port = free_port()
        self.appendonly = appendonly
        self.args = list(args)
        self.auth = auth
        self.proc: subprocess.Popen | None = None
        self.restarts = 0
        self.start()

    @property
    def url(self) -> str:
        return f"redis://127.0.0.1:{self.port}/0"

    def client(self) -> redis.Redis:
        username, password = self.auth or (None, None)
        return redis.Redis(host="127.0.0.1", port=self.port, socket_timeout=5, username=username,
                           password=password)

    def start(self) -> None:
        args = ["redis-server", "--port", str(self.port), "--bind", "127.0.0.1", "--dir", str(self.dir),
                "--save", "", "--appendonly", "yes" if self.appendonly else "no", "--appendfsync", "everysec",
                "--logfile", str(self.dir / "redis.log"), *self.args]
        self.proc = subprocess.Popen(args, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
        deadline = time.monotonic() + STARTUP_TIMEOUT_S
        while True:
            try:
                with self.client() as c:
                    if c.ping():
                        return
            except (redis.ConnectionError, redis.BusyLoadingError):
                pass
            if self.proc.poll() is not None or time.monotonic() > deadline:
                raise RuntimeError(f"private redis-server on {self.port} did not start: "
                                   f"{(self.dir / 'redis.log').read_text()[-2000:]}")
            time.sleep(0.05)

    def stop(self, *, kill: bool = False) -> None:
        """SIGTERM: Redis fsyncs its AOF and exits (a clean restart). kill=True: SIGKILL, as a crash
        (an `everysec` AOF may lose up to its last second)."""
        if self.proc is None:
            return
        if kill:
            self.proc.kill()
        else:
            self.proc.terminate()
        try:
            self.proc.wait(timeout=15)
        except subprocess.TimeoutExpired:
            self.proc.kill()
            self.proc.wait()
        self.proc = None

    def restart(self, *, kill: bool = False, down_s: float = 0.0, lose_data: bool = False) -> None:
        """Stop, stay down for down_s, start again on the same port: with the AOF (the data
        survives), or with lose_data=True from an empty folder (Redis lost everything)."""
        self.stop(kill=kill)
        if lose_data:
            for path in self.dir.iterdir():
                if path.name != "redis.log":
                    shutil.rmtree(path) if path.is_dir() else path.unlink()
        time.sleep(down_s)
        self.restarts += 1
        self.start()

    def kill_clients(self) -> int:
        """CLIENT KILL TYPE normal: every ordinary connection dropped, no data lost."""
        with self.client() as c:
            return int(c.execute_command("CLIENT", "KILL", "TYPE", "normal", "SKIPME", "yes"))

    def close(self) -> None:
        self.stop(kill=True)

    def __enter__(self) -> PrivateRedis:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()
