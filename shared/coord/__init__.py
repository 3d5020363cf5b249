"""Redis coordination between trainer and rollout workers (docs/coordination.md)."""

from shared.coord.coordinator import Coordinator, connect, lost_streams
from shared.coord.errors import CoordError, QueueFull
from shared.coord.keys import Keys
from shared.coord.leases import Lease
from shared.coord.scheduling import claim_size, is_lagging
from shared.coord.settings import CoordSettings
from shared.coord.stats import COUNTERS

__all__ = [
    "COUNTERS",
    "CoordError",
    "CoordSettings",
    "Coordinator",
    "Keys",
    "Lease",
    "QueueFull",
    "claim_size",
    "connect",
    "is_lagging",
    "lost_streams",
]
