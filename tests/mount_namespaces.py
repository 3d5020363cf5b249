"""Whether this machine lets a test mount a tmpfs in a user + mount namespace of its own (`unshare
-rm`): a real filesystem to fill (ENOSPC) without root or touching the host's mounts; and how a
test fills one."""

from __future__ import annotations

import errno
import functools
import os
import shutil
import subprocess
from pathlib import Path

import pytest


@functools.cache
def tmpfs_namespaces_work() -> bool:
    if not shutil.which("unshare"):
        return False
    probe = subprocess.run(["unshare", "-rm", "sh", "-c", "mount -t tmpfs -o size=1m tmpfs /mnt"],
                           capture_output=True)
    return probe.returncode == 0


needs_tmpfs_namespaces = pytest.mark.skipif(
    not tmpfs_namespaces_work(), reason="needs unshare -rm (user and mount namespaces) for a tmpfs")


def fill_until_full(ballast: Path, chunk_bytes: int = 1 << 20) -> None:
    """Write zeros to `ballast` until its filesystem is full (ENOSPC); the file is left there
    (deleting it frees the space again)."""
    fd = os.open(ballast, os.O_WRONLY | os.O_CREAT)
    try:
        while True:
            os.write(fd, bytes(chunk_bytes))
    except OSError as exc:
        assert exc.errno == errno.ENOSPC, exc
    finally:
        os.close(fd)
