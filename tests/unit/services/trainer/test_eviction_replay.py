"""LossConfig.recompute = "replayed": the trainer recomputes the policy's log-probs under the
attention the sampler's compressed cache gave each token, so ξ carries no KV mismatch."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch
from transformers import AutoModelForCausalLM, AutoTokenizer

from services.rollout.engine import KVConfig, LLMEngine, SamplingParams
from services.rollout.models.decoder import load_pretrained
from services.rollout.worker import sampling_info, score_samples
from services.trainer.batching import collate
from services.trainer.kv_budget import evidence_from_step, signal_key
from services.trainer.learner import Learner, LearnerConfig
from services.trainer.optim import OptimSettings
from services.trainer.settings import TrainerSettings
from shared.schemas import Trajectory
from shared.tasks import get_task


@pytest.fixture(scope="module")
def sharp_model_dir(tiny_model_dir: str, tmp_path_factory: pytest.TempPathFactory) -> str:
    """The tiny model with sharp attention (q-norm gains × 6): a random model attends almost
    uniformly, so what the cache evicts would barely change its log-probs."""
    model = AutoModelForCausalLM.from_pretrained(tiny_model_dir)
    with torch.no_grad():
        for layer in model.model.layers:
            layer.self_attn.q_norm.weight.mul_(6.0)
    out = tmp_path_factory.mktemp("sharp-model")
    model.save_pretrained(out)
    AutoTokenizer.from_pretrained(tiny_model_dir).save_pretrained(out)
    return str(out)


def _trajectories(model_dir: str, kv: KVConfig, record: bool = False) -> list[Trajectory]:
    # fp32 sampler and learner: what remains of the mismatch is the KV cache's, not bf16 rounding.
    engine = LLMEngine(load_pretrained(model_dir), compute_dtype=torch.float32)
    engine.record_evictions = record  # what a worker with SPARSECAST_RECORD_EVICTIONS ships
    task = get_task("addition")
    prompts = [[1, 10, 11, 12, 13, 14, 15], [1, 20, 21, 22, 23], [1, 30, 31, 32, 33, 34, 35, 36]]
    out = []
    for g, prompt in enumerate(prompts):
        params = SamplingParams(temperature=1.0, max_new_tokens=24, seed=g)
        outputs = engine.generate([prompt] * 4, params, kv)
        sampling = sampling_info(kv, temperature=1.0)
        samples = score_samples(task, "1", prompt, outputs, lambda ids: "x")
        for i, s in enumerate(samples):  # rewards with variance, so every group has an advantage
            s.reward = float(i % 2)
        out.append(Trajectory(group_id=f"g{g}", attempt=1, policy_version=0, worker_id="w", task="addition",
                              prompt="p", samples=samples, sampling=sampling))
    return out


def _learner(model_dir: str, tmp_path: Path, recompute: str, **loss: object) -> Learner:
    settings = TrainerSettings(model=model_dir, data_dir=str(tmp_path), device="cpu", ppo_updates=1,
                               bf16_autocast=False, loss={"recompute": recompute, **loss},
                               optim=OptimSettings(lr=1e-3))
    return Learner(LearnerConfig.of(settings), Path(model_dir), pad_id=0)


@pytest.mark.parametrize("keep_prompt", [False, True])
def test_replayed_recompute_removes_the_kv_mismatch(sharp_model_dir: str, tmp_path: Path,
                                                    keep_prompt: bool) -> None:
    kv = KVConfig(policy="rkv", budget=6, buffer=2, window=2, keep_prompt=keep_prompt)
    trajectories = _trajectories(sharp_model_dir, kv)
    assert all(s.kv.evicted > 0 for t in trajectories for s in t.samples)
    dense = _learner(sharp_model_dir, tmp_path / "dense", "dense").train_step(trajectories)
    replayed_learner = _learner(sharp_model_dir, tmp_path / "replayed", "replayed")
    before = {k: v.clone() for k, v in replayed_learner.model.state_dict().items()}
    replayed = replayed_learner.train_step(trajectories)
    # The sampler's own attention (fp32 on both sides): its log-probs, where the dense cache differs.
    assert replayed["kl_old_sampler"] < 1e-5 < 1e-3 < dense["kl_old_sampler"]
    assert replayed["rejection_rate"] == 0.0 and replayed["token_mask_rate"] == 0.0
    assert replayed["updates"] == 1
    moved = any(not torch.equal(v, before[k]) for k, v in replayed_learner.model.state_dict().items())
    assert moved


def test_dense_samples_replay_as_causal(sharp_model_dir: str, tmp_path: Path) -> None:
    trajectories = _trajectories(sharp_model_dir, KVConfig(policy="dense"))
    dense = _learner(sharp_model_dir, tmp_path / "dense", "dense").train_step(trajectories)
    replayed = _learner(sharp_model_dir, tmp_path / "replayed", "replayed").train_step(trajectories)
    assert replayed["kl_old_sampler"] == pytest.approx(dense["kl_old_sampler"], abs=1e-4)
    assert replayed["loss"] == pytest.approx(dense["loss"], abs=1e-4)


def test_stale_samples_replay_under_the_weights_that_drew_them(sharp_model_dir: str, tmp_path: Path) -> None:
    kv = KVConfig(policy="rkv", budget=6, buffer=2, window=2, keep_prompt=False)
    trajectories = _trajectories(sharp_model_dir, kv)  # drawn by version 0
    learner = _learner(sharp_model_dir, tmp_path, "replayed")
    for group in learner.optimizer.param_groups:
        group["lr"] = 3e-2  # a large step, so that version 1 evicts otherwise
    learner.train_step(trajectories, version=0)
    assert learner.evict is not None
    v0 = learner._sampled_weights[0]
    prompts = [s.prompt_ids for t in trajectories for s in t.samples]
    completions = [s.completion_ids for t in trajectories for s in t.samples]
    batch = collate(trajectories, pad_id=0)
    masks = learner._replayed_masks(trajectories, batch, version=1)  # one version stale
    assert masks is not None and set(learner._sampled_weights) == {0, 1}
    width = masks.shape[-1]
    under_v0 = learner.evict(v0, prompts, completions, kv)[..., :width, :width]
    under_v1 = learner.evict(learner._sampled_weights[1], prompts, completions, kv)[..., :width, :width]
    assert not torch.equal(under_v0, under_v1)  # the step changed what the cache keeps
    real = batch.attention_mask.bool()
    for row in range(len(prompts)):
        n = int(real[row].sum())
        assert torch.equal(masks[row, :, :, :n, :n], under_v0[row, :, :, :n, :n])


def test_recorded_evictions_stand_in_for_the_replay(sharp_model_dir: str, tmp_path: Path) -> None:
    """A worker's recorded eviction gives the masks the replay would, without running it; a record
    that does not fit the model is replayed instead."""
    kv = KVConfig(policy="rkv", budget=6, buffer=2, window=2, keep_prompt=False)
    recorded = _trajectories(sharp_model_dir, kv, record=True)
    assert all(s.evicted_at is not None for t in recorded for s in t.samples)
    plain = [t.model_copy(update={"samples": [s.model_copy(update={"evicted_at": None}) for s in t.samples]})
             for t in recorded]
    batch = collate(recorded, pad_id=0)
    replaying = _learner(sharp_model_dir, tmp_path / "replay", "replayed")
    replayed = replaying._replayed_masks(plain, batch, version=0)
    assert replaying.replayed_samples == 12
    learner = _learner(sharp_model_dir, tmp_path / "recorded", "replayed")
    from_record = learner._replayed_masks(recorded, batch, version=0)
    assert learner.replayed_samples == 0
    assert replayed is not None and from_record is not None

    def same_over_real_tokens(masks: torch.Tensor) -> bool:  # padding positions are no one's tokens
        lengths = batch.attention_mask.sum(dim=1).tolist()
        return all(torch.equal(masks[r, ..., :n, :n], replayed[r, ..., :n, :n])
                   for r, n in enumerate(lengths))

    assert same_over_real_tokens(from_record)
    first = recorded[0].samples[0]
    assert first.evicted_at is not None
    broken = [recorded[0].model_copy(update={"samples": [first.model_copy(
        update={"evicted_at": first.evicted_at[:-1]})] + recorded[0].samples[1:]})] + recorded[1:]
    masks = learner._replayed_masks(broken, batch, version=0)
    assert masks is not None and same_over_real_tokens(masks)
    assert learner.replayed_samples == 1


def test_the_adaptive_budget_under_replay_reads_the_dense_mismatch(sharp_model_dir: str,
                                                                  tmp_path: Path) -> None:
    """Replayed, the trainer's mismatch figures match the sampler at any budget (a controller reading
    them would take the budget to its floor); with the adaptive budget on, the learner also scores
    the batch against a dense recompute, and that is what the controller reads."""
    kv = KVConfig(policy="rkv", budget=6, buffer=2, window=2, keep_prompt=False)
    trajectories = _trajectories(sharp_model_dir, kv)
    dense = _learner(sharp_model_dir, tmp_path / "dense", "dense").train_step(trajectories)

    def config(recompute: str, mode: str) -> LearnerConfig:
        settings = TrainerSettings(model=sharp_model_dir, data_dir=str(tmp_path), device="cpu", ppo_updates=1,
                                   bf16_autocast=False, loss={"recompute": recompute},
                                   kv_control={"mode": mode}, optim=OptimSettings(lr=1e-3))
        return LearnerConfig.of(settings)

    assert not config("replayed", "fixed").dense_mismatch and not config("dense", "adaptive").dense_mismatch
    learner = Learner(config("replayed", "adaptive"), Path(sharp_model_dir), pad_id=0)
    metrics = learner.train_step(trajectories)
    assert metrics["kl_old_sampler"] < 1e-5 < 1e-3 < metrics["dense_kl_old_sampler"]
    # The same weights and batch as the dense learner's step: its figures.
    assert metrics["dense_kl_old_sampler"] == pytest.approx(dense["kl_old_sampler"], rel=1e-3)
    for name in ("divergent_rate", "rejection_rate"):
        assert metrics[f"dense_{name}"] == pytest.approx(dense[name], abs=1 / 12)  # 12 sequences
    assert metrics["by_staleness"]["0"]["dense_kl_old_sampler"] == metrics["dense_kl_old_sampler"]
    key = signal_key("kl_old_sampler", learner.config.dense_mismatch)
    [evidence] = evidence_from_step(trajectories, metrics, 0, key)
    assert evidence.value == metrics["dense_kl_old_sampler"] and evidence.budget == 6
    assert signal_key("kl_old_sampler", dense_mismatch=False) == "kl_old_sampler"


def test_the_rule_under_replay_can_judge_divergence_against_a_dense_recompute(sharp_model_dir: str,
                                                                               tmp_path: Path) -> None:
    """`divergence_against = "dense"`: under replay the recompute matches the sampler, so the default
    rule alone vetoes nothing; judged against a dense recompute, the losers that diverge from it go
    (the same sequences a dense-recompute learner vetoes), and the step is scaled by the survivors."""
    kv = KVConfig(policy="rkv", budget=6, buffer=2, window=2, keep_prompt=False)
    trajectories = _trajectories(sharp_model_dir, kv)

    def step(name: str, recompute: str, **loss: object) -> dict:
        # The tiny model's cache moves ξ by up to ~25 %: a band of ±5 % makes that divergence.
        corrections = {"mask_low": 0.95, "mask_high": 1.05}
        learner = _learner(sharp_model_dir, tmp_path / name, recompute, corrections=corrections, **loss)
        return learner.train_step(trajectories)

    dense = step("dense", recompute="dense")
    assert 0 < dense["rejection_rate"] < dense["divergent_rate"]  # divergent losers vetoed, winners kept
    replayed = step("replayed", recompute="replayed")
    assert replayed["rejection_rate"] == 0.0 and replayed["lr_scale"] == 1.0
    judged = step("judged", recompute="replayed", divergence_against="dense")
    # The same weights and batch: the dense recompute is the dense learner's old log-probs.
    for name in ("rejection_rate", "divergent_rate"):
        assert judged[name] == dense[name]
    assert judged["kl_old_sampler"] < 1e-5  # ξ, the mask and the loss stay the replayed recompute's
    assert judged["lr_scale"] == pytest.approx(1.0 - judged["rejection_rate"])
