"""A lease: a prompt group delivered to one worker, held while its stream entry stays pending."""

from __future__ import annotations

from dataclasses import dataclass

from shared.schemas import PromptGroup


@dataclass(frozen=True)
class Lease:
    entry_id: str  # stream entry id in the prompt stream
    worker_id: str  # consumer name in the rollout consumer group
    attempt: int  # delivery count of the entry when claimed: 1 on first delivery
    group: PromptGroup
    claimed_at: float  # unix seconds, for the worker's own bookkeeping

    @property
    def group_id(self) -> str:
        return self.group.id
