"""Trajectory signatures: an HMAC-SHA256 by the worker credential (SPARSECAST_WORKER_TOKEN).

Anyone who can write to the run's Redis stream could otherwise hand the trainer trajectories of
their choosing; a signature shows that a holder of the worker token produced this exact content
for this run. The signed message is a canonical encoding of every field but `signature` (ASCII JSON
with sorted keys and no spaces: floats print as their shortest round-trip form, so the trainer,
which parses the JSON the worker wrote, re-encodes the same bytes), after a context that names the
run, so a trajectory signed for one run is not valid in another.
"""

from __future__ import annotations

import hashlib
import hmac
import json
import re

from shared.schemas import Trajectory

CONTEXT = b"sparsecast trajectory v1\0"
SIGNATURE = re.compile(r"[0-9a-f]{64}")  # hex of an HMAC-SHA256


def trajectory_message(trajectory: Trajectory, run: str) -> bytes:
    """The bytes a signature covers: the context, the run and the canonical trajectory."""
    # ASCII with escapes: any str the JSON parser accepts (a lone surrogate too) encodes.
    body = json.dumps(trajectory.model_dump(mode="json", exclude={"signature"}), sort_keys=True,
                      separators=(",", ":"), ensure_ascii=True)
    return CONTEXT + run.encode() + b"\0" + body.encode("ascii")


def trajectory_signature(trajectory: Trajectory, token: str, run: str) -> str:
    """The hex HMAC-SHA256 of the trajectory's message under `token`."""
    return hmac.new(token.encode(), trajectory_message(trajectory, run), hashlib.sha256).hexdigest()


def sign_trajectory(trajectory: Trajectory, token: str, run: str) -> Trajectory:
    """A copy of the trajectory carrying its signature."""
    return trajectory.model_copy(update={"signature": trajectory_signature(trajectory, token, run)})


def signature_valid(trajectory: Trajectory, token: str, run: str) -> bool:
    """True when the trajectory carries the signature `token` makes of it for `run`."""
    given = trajectory.signature
    if given is None or not SIGNATURE.fullmatch(given):  # also keeps compare_digest to ASCII
        return False
    return hmac.compare_digest(given, trajectory_signature(trajectory, token, run))
