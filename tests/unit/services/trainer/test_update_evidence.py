"""No update without evidence: a batch whose corrections leave nothing moves nothing, and a batch
with few survivors moves the weights less than a full one (docs/training.md)."""

from __future__ import annotations

import random
from pathlib import Path

import torch

from services.trainer.batching import collate
from services.trainer.learner import Learner, LearnerConfig
from services.trainer.optim import OptimSettings
from services.trainer.settings import TrainerSettings
from shared.schemas import KVStats, Sample, Trajectory


def _learner(model_dir: str, tmp_path: Path, **loss: object) -> Learner:
    settings = TrainerSettings(model=model_dir, data_dir=str(tmp_path), device="cpu",
                               optim=OptimSettings(lr=1e-3), bf16_autocast=False, ppo_updates=1, loss=loss)
    return Learner(LearnerConfig.of(settings), Path(model_dir), pad_id=0)


def _batch(vocab: int, groups: int = 5, samples: int = 4, seed: int = 0) -> list[Trajectory]:
    """Groups with reward variance; sampler log-probs filled in later."""
    rng = random.Random(seed)
    out = []
    for g in range(groups):
        prompt = [1] + [rng.randrange(4, vocab) for _ in range(5)]
        items = []
        for s in range(samples):
            completion = [rng.randrange(4, vocab) for _ in range(rng.randrange(4, 9))]
            items.append(Sample(completion="x", prompt_ids=prompt, completion_ids=completion,
                                logprobs=[0.0] * len(completion), reward=float(s % 2), correct=s % 2 == 1,
                                finish_reason="stop", kv=KVStats()))
        out.append(Trajectory(group_id=f"g{g}", attempt=1, policy_version=0, worker_id="w", task="addition",
                              prompt="p", samples=items))
    return out


def _with_sampler_logprobs(learner: Learner, trajectories: list[Trajectory],
                           survivors: set[int]) -> list[Trajectory]:
    """Sequences in `survivors` (flat index) get the dense policy's own log-probs (ξ = 1: they
    survive everything); the others log-prob 0, so ξ = π_dense ≪ 0.5 masks every token."""
    batch = collate(trajectories, learner.pad_id)
    with torch.no_grad():
        dense = learner._logprobs_all(learner.model, batch)
    out, row = [], 0
    for t in trajectories:
        samples = []
        for s in t.samples:
            p, c = len(s.prompt_ids), len(s.completion_ids)
            logprobs = dense[row, p:p + c].tolist() if row in survivors else [0.0] * c
            samples.append(s.model_copy(update={"logprobs": logprobs}))
            row += 1
        out.append(t.model_copy(update={"samples": samples}))
    return out


def _weights(learner: Learner) -> dict[str, torch.Tensor]:
    return {k: v.detach().clone() for k, v in learner.model.state_dict().items()}


def _moved(before: dict[str, torch.Tensor], learner: Learner) -> float:
    after = learner.model.state_dict()
    return float(sum((after[k].float() - v.float()).norm() ** 2 for k, v in before.items()) ** 0.5)


def test_a_batch_with_no_surviving_token_moves_nothing(tiny_model_dir: str, tmp_path: Path) -> None:
    learner = _learner(tiny_model_dir, tmp_path)
    # Warm the optimizer up first, so that momentum and weight decay would move the weights.
    trajectories = _batch(vocab=90)
    learner.train_step(_with_sampler_logprobs(learner, trajectories, set(range(20))))
    before = _weights(learner)
    optim_before = {k: {n: v.clone() if torch.is_tensor(v) else v for n, v in state.items()}
                    for k, state in learner.optimizer.state.items()}
    assert optim_before, "the warm-up step did not run"
    metrics = learner.train_step(_with_sampler_logprobs(learner, trajectories, set()))
    assert metrics["updates"] == 0 and metrics["skipped_updates"] == 1 and metrics["grad_norm"] == 0.0
    for name, tensor in learner.model.state_dict().items():
        assert torch.equal(tensor, before[name]), name
    for param, state in learner.optimizer.state.items():
        for key, value in state.items():
            old = optim_before[param][key]
            assert torch.equal(value, old) if torch.is_tensor(value) else value == old, key


def test_an_all_vetoed_batch_moves_nothing(tiny_model_dir: str, tmp_path: Path) -> None:
    # ξ = 1 everywhere, but a veto threshold above 1 rejects every sequence.
    learner = _learner(tiny_model_dir, tmp_path, corrections={"veto_threshold": 2.0})
    trajectories = _with_sampler_logprobs(learner, _batch(vocab=90), set(range(20)))
    before = _weights(learner)
    metrics = learner.train_step(trajectories)
    assert metrics["rejection_rate"] == 1.0 and metrics["updates"] == 0
    assert not learner.optimizer.state  # AdamW never stepped: no moments, no step count
    assert all(torch.equal(t, before[k]) for k, t in learner.model.state_dict().items())


def test_few_survivors_move_the_weights_less_than_a_full_batch(tiny_model_dir: str, tmp_path: Path) -> None:
    trajectories = _batch(vocab=90)  # 20 sequences; 1 surviving = 5 %
    moved = {}
    for label, survivors, scale in (("full", set(range(20)), True), ("five_percent", {1}, True),
                                    ("five_percent_unscaled", {1}, False)):
        learner = _learner(tiny_model_dir, tmp_path / label, scale_lr_by_survivors=scale)
        batch = _with_sampler_logprobs(learner, trajectories, survivors)
        before = _weights(learner)
        metrics = learner.train_step(batch)
        assert metrics["updates"] == 1
        moved[label] = _moved(before, learner)
    # Adam's first step moves each weight by ~lr whatever the gradient's scale: unscaled, one
    # sequence moves the weights about as far as twenty (the failure this rule prevents).
    assert moved["five_percent_unscaled"] > 0.5 * moved["full"]
    assert 0 < moved["five_percent"] < 0.1 * moved["full"]


def test_a_minimum_of_surviving_sequences(tiny_model_dir: str, tmp_path: Path) -> None:
    # The authors' token rule: the non-survivors are masked token by token, none vetoed.
    learner = _learner(tiny_model_dir, tmp_path, min_surviving_sequences=3,
                       corrections={"divergence_rule": "token"})
    before = _weights(learner)
    metrics = learner.train_step(_with_sampler_logprobs(learner, _batch(vocab=90), {0, 5}))
    assert metrics["updates"] == 0 and metrics["rejection_rate"] == 0.0
    assert all(torch.equal(t, before[k]) for k, t in learner.model.state_dict().items())
    metrics = learner.train_step(_with_sampler_logprobs(learner, _batch(vocab=90), {0, 5, 9}))
    assert metrics["updates"] == 1 and metrics["lr_scale"] == 3 / 20


def test_a_full_step_from_a_surviving_share(tiny_model_dir: str, tmp_path: Path) -> None:
    # full_step_share 0.5: from half the sequences surviving the step is full, below it lr × share / 0.5.
    learner = _learner(tiny_model_dir, tmp_path / "half", full_step_share=0.5,
                       corrections={"divergence_rule": "token"})
    metrics = learner.train_step(_with_sampler_logprobs(learner, _batch(vocab=90), set(range(12))))
    assert metrics["updates"] == 1 and metrics["lr_scale"] == 1.0  # 12 of 20 survive
    metrics = learner.train_step(_with_sampler_logprobs(learner, _batch(vocab=90), {0, 5}))
    assert metrics["updates"] == 1 and metrics["lr_scale"] == 2 / 20 / 0.5
