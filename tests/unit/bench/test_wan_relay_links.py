"""The relay bench's heterogeneous links (bench/wan_relay.py worker_links, `--slow-workers`)."""

from __future__ import annotations

import pytest

from bench.wan_relay import WORKERS, worker_links
from bench.wan_stack import GBIT, MBIT


def test_slow_workers_serve_slowly_from_the_second_in_the_order() -> None:
    links, slow = worker_links(GBIT, 2, 100 * MBIT)
    assert slow == [1, 2] and len(links) == WORKERS
    assert [x.up_bps for x in links] == [GBIT, 100 * MBIT, 100 * MBIT] + [GBIT] * (WORKERS - 3)
    assert all(x.down_bps == GBIT for x in links)  # they receive at the full rate
    plain, none = worker_links(GBIT)
    assert none == [] and all(x.up_bps == x.down_bps == GBIT for x in plain)


@pytest.mark.parametrize(("slow", "mbit"), [(-1, 100), (WORKERS - 1, 100), (1, 0)])
def test_the_head_and_the_last_stay_fast_and_a_rate_is_positive(slow: int, mbit: float) -> None:
    with pytest.raises(ValueError):
        worker_links(GBIT, slow, mbit * MBIT)
