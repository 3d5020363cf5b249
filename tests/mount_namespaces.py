"""Whether this machine lets a test mount a tmpfs in a user + mount namespace of its own (`unshare
-rm`): a real filesystem to fill (ENOSPC) without root or touching the host's mounts."""

from __future__ import annotations

import functools
import shutil
import subprocess

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
