"""The rollout worker's sampling seed: reproducible per batch of groups, fresh on redelivery."""

from services.rollout.worker import batch_seed
from shared.coord import Lease
from shared.schemas import PromptGroup


def _lease(group_id: str, attempt: int = 1) -> Lease:
    group = PromptGroup(id=group_id, task="addition", prompt="add 12+34\n", answer="46")
    return Lease(entry_id="0-1", worker_id="w", attempt=attempt, group=group, claimed_at=0.0)


def test_batch_seed_depends_only_on_groups_and_attempts():
    batch = [_lease("g1"), _lease("g2")]
    seed = batch_seed(batch)
    assert seed == batch_seed(
        [_lease("g1"), _lease("g2")]
    )  # a different claim time or entry id changes nothing
    assert 0 <= seed < 2**63
    assert seed != batch_seed([_lease("g1", attempt=2), _lease("g2")])  # redelivered: fresh samples
    assert seed != batch_seed([_lease("g2"), _lease("g1")])
    assert seed != batch_seed([_lease("g1")])
