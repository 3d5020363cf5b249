"""services.trainer.admission: a trajectory is trained only for a group the ledger admitted and
still holds open, with the admitted prompt and task, rewards the task itself gives, the trained
tokens matching the scored text, and (with a worker token) the worker's valid signature."""

from __future__ import annotations

from pathlib import Path

import pytest

from services.rollout.engine.config import GenerationOutput
from services.rollout.worker import score_samples
from services.trainer import admission
from services.trainer.admission import refusal
from services.trainer.ledger import GroupLedger
from shared.schemas import KVStats, PromptGroup, Trajectory, WorkerInfo
from shared.signing import sign_trajectory
from shared.tasks import get_task
from shared.tokenizer import build_tokenizer

RUN, TOKEN = "r", "worker-secret"
TOKENIZER = build_tokenizer()
GROUP = PromptGroup(id="g1", task="addition", prompt="Add: 12+30\n", answer="42", samples=3)
COMPLETIONS = ("=42", "=41", "no answer")  # correct, half credit, unparsable


def encode(text: str) -> list[int]:
    return list(TOKENIZER(text).input_ids)


def decode(ids: list[int]) -> str:
    return str(TOKENIZER.decode(list(ids), skip_special_tokens=True))


def honest(group: PromptGroup = GROUP, completions: tuple[str, ...] = COMPLETIONS) -> Trajectory:
    """What a worker produces for `group` (its scoring code, the same tokenizer)."""
    outputs = [GenerationOutput(token_ids=encode(text)[1:] + [TOKENIZER.eos_token_id],  # no BOS, with EOS
                                logprobs=[-0.5] * len(text) + [-0.1], finish_reason="stop", kv=KVStats())
               for text in completions]
    samples = score_samples(get_task(group.task), group.answer or "", encode(group.prompt), outputs, decode)
    return Trajectory(group_id=group.id, attempt=1, policy_version=0, worker_id="w1", task=group.task,
                      prompt=group.prompt, samples=samples)


@pytest.fixture
def ledger(tmp_path: Path) -> GroupLedger:
    ledger = GroupLedger.in_dir(tmp_path, RUN)
    for group in (GROUP, GROUP.model_copy(update={"id": "trained"}), GROUP.model_copy(update={"id": "dead"})):
        ledger.open[group.id] = group
    ledger.settle_trained(["trained"], version=1)
    ledger.settle_dead(["dead"])
    return ledger


def test_an_honest_trajectory_of_an_admitted_group_is_accepted(ledger: GroupLedger) -> None:
    trajectory = honest()
    assert [s.reward for s in trajectory.samples] == [1.0, 0.25, 0.0]  # full, partial and no credit
    assert refusal(trajectory, ledger, None, TOKENIZER) is None
    assert refusal(sign_trajectory(trajectory, TOKEN, RUN), ledger, TOKEN, TOKENIZER) is None
    assert refusal(trajectory, ledger, None) is None  # without a tokenizer: texts and rewards alone


def test_a_group_never_admitted_is_refused(ledger: GroupLedger) -> None:
    forged = honest(GROUP.model_copy(update={"id": "never-submitted"}))
    assert refusal(forged, ledger, None, TOKENIZER) == admission.NOT_ADMITTED
    assert refusal(honest(GROUP.model_copy(update={"id": "dead"})), ledger, None) == admission.DEAD


def test_a_group_already_trained_is_left_to_the_duplicate_check(ledger: GroupLedger) -> None:
    # Redis handing out a trained group again is a duplicate, dropped and counted as one by the trainer.
    assert refusal(honest(GROUP.model_copy(update={"id": "trained"})), ledger, None) is None


def test_a_chosen_reward_is_refused(ledger: GroupLedger) -> None:
    trajectory = honest()
    trajectory.samples[1].reward = 1.0  # the half-credit sample claims full reward
    assert refusal(trajectory, ledger, None, TOKENIZER) == admission.REWARD_DIFFERS
    trajectory = honest()
    trajectory.samples[2].correct = True
    assert refusal(trajectory, ledger, None, TOKENIZER) == admission.REWARD_DIFFERS


def test_a_changed_prompt_task_or_sample_count_is_refused(ledger: GroupLedger) -> None:
    other = honest().model_copy(update={"prompt": "Add: 1+1\n"})
    assert refusal(other, ledger, None) == admission.PROMPT_DIFFERS
    assert refusal(honest().model_copy(update={"task": "sorting"}), ledger, None) == admission.TASK_DIFFERS
    two = honest()
    two.samples.pop()
    assert refusal(two, ledger, None) == admission.SAMPLES_DIFFER


def test_trained_tokens_must_be_the_scored_text(ledger: GroupLedger) -> None:
    # A correct text over other token ids would train those ids with the correct answer's reward.
    swapped = honest()
    swapped.samples[0].completion_ids = swapped.samples[2].completion_ids
    swapped.samples[0].logprobs = swapped.samples[2].logprobs
    assert refusal(swapped, ledger, None, TOKENIZER) == admission.TEXT_DIFFERS
    other_prompt = honest()
    other_prompt.samples[0].prompt_ids = encode("Add: 99+1\n")
    assert refusal(other_prompt, ledger, None, TOKENIZER) == admission.PROMPT_IDS_DIFFER


def test_with_a_worker_token_unsigned_and_badly_signed_trajectories_are_refused(ledger: GroupLedger) -> None:
    assert refusal(honest(), ledger, TOKEN, TOKENIZER) == admission.UNSIGNED
    assert refusal(sign_trajectory(honest(), "another", RUN), ledger, TOKEN) == admission.BAD_SIGNATURE
    assert refusal(sign_trajectory(honest(), TOKEN, "other-run"), ledger, TOKEN) == admission.BAD_SIGNATURE
    tampered = sign_trajectory(honest(), TOKEN, RUN)
    tampered.samples[1].reward = 1.0
    assert refusal(tampered, ledger, TOKEN) == admission.BAD_SIGNATURE
    # A signed trajectory still has to be of an admitted group (the signature proves its author only).
    assert refusal(sign_trajectory(honest(GROUP.model_copy(update={"id": "x"})), TOKEN, RUN), ledger,
                   TOKEN) == admission.NOT_ADMITTED


def test_reasons_name_no_group_so_counts_by_reason_stay_few(ledger: GroupLedger) -> None:
    reasons = {refusal(honest(GROUP.model_copy(update={"id": f"g{i}x"})), ledger, None) for i in range(50)}
    assert reasons == {admission.NOT_ADMITTED}


def test_a_worker_without_the_token_is_flagged_when_the_trainer_requires_one() -> None:
    unsigned, signing = WorkerInfo(worker_id="old"), WorkerInfo(worker_id="new", signs=True)
    assert admission.worker_refusal(unsigned, TOKEN) == admission.UNSIGNED_WORKER
    assert admission.worker_refusal(signing, TOKEN) is None
    assert admission.worker_refusal(unsigned, None) is None  # signatures not required


@pytest.mark.parametrize("ids", [[-1], [10**9], [5, len(TOKENIZER)]])
def test_token_ids_outside_the_vocabulary_are_refused_not_raised(ledger: GroupLedger, ids: list[int]) -> None:
    forged = honest()
    forged.samples[0].completion_ids, forged.samples[0].logprobs = ids, [-1.0] * len(ids)
    assert refusal(forged, ledger, None, TOKENIZER) == admission.TOKEN_IDS_INVALID


def test_a_forgery_with_text_no_utf8_takes_is_refused_not_raised(ledger: GroupLedger) -> None:
    forged = honest().model_copy(update={"prompt": GROUP.prompt + "\ud800"})
    assert refusal(forged, ledger, TOKEN, TOKENIZER) == admission.UNSIGNED
    assert refusal(sign_trajectory(forged, "guess", RUN), ledger, TOKEN, TOKENIZER) == admission.BAD_SIGNATURE
    assert refusal(forged, ledger, None, TOKENIZER) == admission.PROMPT_DIFFERS
