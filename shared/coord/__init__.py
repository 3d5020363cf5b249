"""Redis coordination between trainer and rollout workers (docs/coordination.md)."""

from shared.coord.coordinator import Coordinator, connect, lost_streams
from shared.coord.errors import CoordError, QueueFull
from shared.coord.keys import Keys
from shared.coord.leases import Lease
from shared.coord.scheduling import StallMeter, claim_size, effective_rate, is_lagging
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
    "StallMeter",
    "claim_size",
    "connect",
    "effective_rate",
    "is_lagging",
    "lost_streams",
]
