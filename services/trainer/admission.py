"""Which trajectories the trainer may train: only admitted data, from a worker it knows.

Whoever can write to the run's Redis stream can put a trajectory there; the trainer must not
train what it reads on trust. A trajectory is admitted when
- it carries a valid signature by the worker credential (shared.signing), if the trainer has one;
- its group is one the trainer's ledger admitted and that is still open (submitted, neither
  trained nor dead-lettered); a group already trained is left to the trainer's duplicate check,
  which drops it and counts it as a duplicate;
- its task, prompt and number of samples are the ledger's, and each sample's reward and
  correctness are what the task's reward gives against the ledger's answer (the trajectory's own
  reward is never trusted); given the trainer's tokenizer, the prompt ids are the prompt's tokens
  and each completion's text is its token ids decoded, so the scored text is the trained text.

`refusal` is pure (no I/O): it answers why a trajectory is refused, one of a few fixed reasons
(the trainer counts refusals by reason, so reasons name no group or value), or None.
"""

from __future__ import annotations

import math
from collections.abc import Mapping, Sequence, Set
from typing import TYPE_CHECKING, Protocol

from shared.schemas import PromptGroup, Trajectory, WorkerInfo
from shared.signing import signature_valid
from shared.tasks import get_task

if TYPE_CHECKING:  # the trainer's tokenizer; typing only, so this module stays light
    from transformers import PreTrainedTokenizerBase as Tokenizer

UNSIGNED = "unsigned trajectory: this trainer requires the worker token (SPARSECAST_WORKER_TOKEN)"
BAD_SIGNATURE = "bad signature: not signed with this trainer's worker token for this run"
NOT_ADMITTED = "group never admitted by this trainer"
DEAD = "group already dead-lettered"
TASK_DIFFERS = "task differs from the admitted group's"
PROMPT_DIFFERS = "prompt differs from the admitted group's"
SAMPLES_DIFFER = "number of samples differs from the admitted group's"
PROMPT_IDS_DIFFER = "prompt token ids are not the admitted prompt's tokens"
TEXT_DIFFERS = "completion text is not its token ids decoded"
TOKEN_IDS_INVALID = "completion token ids outside the vocabulary"
REWARD_DIFFERS = "reward differs from the task's score of the completion"
REWARD_FAILED = "the task's reward failed on a completion"
UNKNOWN_TASK = "the admitted group's task is unknown to this trainer"
UNSIGNED_WORKER = "signs no trajectories (no SPARSECAST_WORKER_TOKEN): this trainer refuses them"
# The same reward function on the same text gives the same float; this only absorbs a JSON trip.
REWARD_TOLERANCE = 1e-9


class Ledger(Protocol):
    """What admission reads of the trainer's ledger (services.trainer.ledger.GroupLedger); read
    only, so the ledger's own dict and sets fit."""

    @property
    def run(self) -> str: ...

    @property
    def open(self) -> Mapping[str, PromptGroup]: ...

    @property
    def trained(self) -> Set[str]: ...

    @property
    def dead(self) -> Set[str]: ...


def refusal(trajectory: Trajectory, ledger: Ledger, worker_token: str | None,
            tokenizer: Tokenizer | None = None) -> str | None:
    """Why the trainer must not train this trajectory, or None when it may. `worker_token`: the
    credential workers sign with (None: signatures are not required); `tokenizer`: the trainer's,
    to check the token ids against the texts (None: texts and rewards are checked alone)."""
    if worker_token:
        if trajectory.signature is None:
            return UNSIGNED
        if not signature_valid(trajectory, worker_token, ledger.run):
            return BAD_SIGNATURE
    gid = trajectory.group_id
    if gid in ledger.trained:
        return None  # a duplicate: the trainer's own check drops it (and counts it as one)
    if gid in ledger.dead:
        return DEAD
    group = ledger.open.get(gid)
    if group is None:
        return NOT_ADMITTED
    return content_refusal(trajectory, group, tokenizer)


def worker_refusal(worker: WorkerInfo, worker_token: str | None) -> str | None:
    """Why every trajectory of this worker will be refused (what it reports of itself), or None:
    shown beside the worker in the trainer's status."""
    return UNSIGNED_WORKER if worker_token and not worker.signs else None


def content_refusal(trajectory: Trajectory, group: PromptGroup,
                    tokenizer: Tokenizer | None = None) -> str | None:
    """Why the trajectory is not a faithful answer to the admitted `group`, or None."""
    if trajectory.task != group.task:
        return TASK_DIFFERS
    if trajectory.prompt != group.prompt:
        return PROMPT_DIFFERS
    if len(trajectory.samples) != group.samples:
        return SAMPLES_DIFFER
    try:
        task = get_task(group.task)
    except KeyError:
        return UNKNOWN_TASK
    prompt_ids = _encode(tokenizer, group.prompt) if tokenizer is not None else None
    answer = group.answer or ""  # as the worker scores (services.rollout.worker)
    for sample in trajectory.samples:
        if tokenizer is not None:
            if sample.prompt_ids != prompt_ids:
                return PROMPT_IDS_DIFFER
            # Checked before decoding: an id out of range makes the tokenizer raise (or the
            # learner's embedding lookup fail), and a forgery must be refused, never crash the trainer.
            if not all(0 <= i < len(tokenizer) for i in sample.completion_ids):
                return TOKEN_IDS_INVALID
            if _decode(tokenizer, sample.completion_ids) != sample.completion:
                return TEXT_DIFFERS
        try:
            reward, correct = task.reward(sample.completion, answer)
        except Exception:  # noqa: BLE001 - a reward that raises scores nothing we could train
            return REWARD_FAILED
        if correct != sample.correct or not math.isclose(reward, sample.reward, rel_tol=0.0,
                                                          abs_tol=REWARD_TOLERANCE):
            return REWARD_DIFFERS
    return None


def _encode(tokenizer: Tokenizer, text: str) -> list[int]:
    # As RolloutCore.encode: the tokenizer's ids with its special tokens (e.g. BOS).
    return list(tokenizer(text).input_ids)


def _decode(tokenizer: Tokenizer, ids: Sequence[int]) -> str:
    # As RolloutCore.decode: special tokens (EOS, padding) left out of the scored text.
    return str(tokenizer.decode(list(ids), skip_special_tokens=True))
