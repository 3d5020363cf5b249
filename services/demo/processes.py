"""The demo's child processes: each in its own process group, logged, stopped without leftovers."""

from __future__ import annotations

import contextlib
import ctypes
import os
import signal
import subprocess
import sys
import time
from collections.abc import Callable, Iterator
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

STOP_GRACE_S = 20.0


class DemoFailed(Exception):
    """A child did not start or died; the message says which and where its log is."""


class Interrupted(Exception):
    """SIGINT or SIGTERM arrived."""


def _die_with_parent() -> None:
    """Runs in the child before exec: SIGTERM it if the demo itself is killed (Linux only)."""
    with contextlib.suppress(OSError, AttributeError):
        ctypes.CDLL("libc.so.6", use_errno=True).prctl(1, signal.SIGTERM)  # PR_SET_PDEATHSIG


@dataclass
class Child:
    name: str
    popen: subprocess.Popen
    log: Path

    def alive(self) -> bool:
        return self.popen.poll() is None

    def log_tail(self, lines: int = 15) -> str:
        try:
            text = self.log.read_text(errors="replace").splitlines()
        except OSError:
            return ""
        return "\n".join(text[-lines:])


@dataclass
class Processes:
    """The children of this demo; `stop_all` leaves none of their process groups alive."""

    log_dir: Path
    children: list[Child] = field(default_factory=list)
    hurry: bool = False  # a second Ctrl-C: skip the grace period

    def start(self, name: str, argv: list[str], env: dict[str, str], cwd: Path) -> Child:
        log = self.log_dir / f"{name}.log"
        with log.open("ab") as out:
            popen = subprocess.Popen(argv, env=env, cwd=cwd, stdin=subprocess.DEVNULL, stdout=out,
                                     stderr=subprocess.STDOUT, start_new_session=True,
                                     preexec_fn=_die_with_parent if sys.platform == "linux" else None)
        child = Child(name, popen, log)
        self.children.append(child)
        return child

    def check(self) -> None:
        for child in self.children:
            if not child.alive():
                raise DemoFailed(f"{child.name} exited with status {child.popen.returncode}; its log "
                                 f"({child.log}) ends with:\n{child.log_tail()}")

    def stop(self, names: Callable[[Child], bool], grace: float) -> None:
        chosen = [c for c in self.children if names(c)]
        for child in chosen:
            if child.alive():
                with contextlib.suppress(ProcessLookupError):
                    os.killpg(child.popen.pid, signal.SIGTERM)
        deadline = time.monotonic() + grace
        while any(c.alive() for c in chosen) and time.monotonic() < deadline and not self.hurry:
            time.sleep(0.1)
        for child in chosen:
            # Also when the leader is gone: anything it forked into its group goes too.
            with contextlib.suppress(ProcessLookupError, PermissionError):
                os.killpg(child.popen.pid, signal.SIGKILL)
            child.popen.wait()

    def stop_all(self) -> None:
        # Workers first (they hand their leases back) with the trainer; the registry and Redis,
        # which those use while shutting down, last.
        self.stop(lambda c: c.name not in ("registry", "redis"), STOP_GRACE_S)
        self.stop(lambda c: True, STOP_GRACE_S / 2)


@contextlib.contextmanager
def signals_raise() -> Iterator[None]:
    """SIGINT/SIGTERM raise Interrupted; during shutdown a second one only hurries it up."""
    previous = {s: signal.getsignal(s) for s in (signal.SIGINT, signal.SIGTERM)}

    def handler(signum: int, frame: Any) -> None:
        raise Interrupted(signal.Signals(signum).name)

    for s in previous:
        signal.signal(s, handler)
    try:
        yield
    finally:
        for s, h in previous.items():
            signal.signal(s, h)
