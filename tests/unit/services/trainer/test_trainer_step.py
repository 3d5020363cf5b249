"""The trainer core without HTTP: collation, one GRPO step, micro-batching equivalence, bf16 publishing."""

from __future__ import annotations

import math
import random
from pathlib import Path

import pytest
import torch

from services.trainer.batching import collate
from services.trainer.core import Trainer
from services.trainer.learner import Learner, LearnerConfig, published_state
from services.trainer.optim import OptimSettings
from services.trainer.settings import PublishSettings, TrainerSettings
from shared.patch import apply_patch, extract_patch, fingerprint, read_header
from shared.sampling import SamplingSettings
from shared.schemas import KVStats, Sample, SamplingInfo, Trajectory
from shared.tasks.addition import AdditionTask


def _trajectories(vocab: int, groups: int = 3, samples: int = 4, seed: int = 0) -> list[Trajectory]:
    rng = random.Random(seed)
    out = []
    for g in range(groups):
        prompt = [1] + [rng.randrange(4, vocab) for _ in range(rng.randrange(3, 7))]
        items = []
        for _ in range(samples):
            completion = [rng.randrange(4, vocab) for _ in range(rng.randrange(2, 9))]
            items.append(Sample(completion="x", prompt_ids=prompt, completion_ids=completion,
                                logprobs=[-rng.uniform(0.5, 6.0) for _ in completion], reward=rng.random(),
                                correct=rng.random() < 0.3, finish_reason="stop",
                                kv=KVStats(peak_tokens=len(prompt) + 2, peak_bytes=100, evicted=1)))
        out.append(Trajectory(group_id=f"g{g}", attempt=1, policy_version=0, worker_id="w", task="addition",
                              prompt="p", samples=items))
    return out


def _settings(model_dir: str, tmp_path: Path, lr: float = 1e-3, **overrides) -> TrainerSettings:
    # These samples' log-probs are random, so most sequences have a divergent token; the tests here are
    # about the step's mechanics, under the authors' token rule (the rules: test_divergence_rules.py).
    loss = {"corrections": {"divergence_rule": "token"}} | overrides.pop("loss", {})
    return TrainerSettings(model=model_dir, data_dir=str(tmp_path), optim=OptimSettings(lr=lr), loss=loss,
                           **({"device": "cpu"} | overrides))


def _trainer(model_dir: str, tmp_path: Path, **overrides) -> Trainer:
    return Trainer(_settings(model_dir, tmp_path, **overrides), registry=None, coord=None,  # type: ignore[arg-type]
                   model_dir=Path(model_dir))


def _learner(model_dir: str, tmp_path: Path, **overrides) -> Learner:
    return Learner(LearnerConfig.of(_settings(model_dir, tmp_path, **overrides)), Path(model_dir), pad_id=0)


def test_collate_aligns_sampler_logprobs_with_completion_tokens() -> None:
    trajectories = _trajectories(vocab=50, groups=2, samples=2)
    batch = collate(trajectories, pad_id=0)
    for row, (g, s) in enumerate((g, s) for g, t in enumerate(trajectories) for s in t.samples):
        p, c = len(s.prompt_ids), len(s.completion_ids)
        assert batch.input_ids[row, p: p + c].tolist() == s.completion_ids
        assert batch.completion_mask[row].sum() == c and batch.completion_mask[row, p] == 1
        assert torch.allclose(batch.logp_sampler[row, p: p + c], torch.tensor(s.logprobs))
        assert batch.attention_mask[row].sum() == p + c and batch.group_index[row] == g
    assert batch.staleness(trainer_version=2) == {2: 2}
    with pytest.raises(ValueError):
        collate([], pad_id=0)


def test_micro_batching_gives_the_same_update(tiny_model_dir: str, tmp_path: Path) -> None:
    trajectories = _trajectories(vocab=90)
    whole = _learner(tiny_model_dir, tmp_path / "a", micro_batch=64, bf16_autocast=False)
    split = _learner(tiny_model_dir, tmp_path / "b", micro_batch=2, bf16_autocast=False)
    m_whole = whole.train_step(trajectories)
    m_split = split.train_step(trajectories)
    assert m_whole["loss"] == pytest.approx(m_split["loss"], rel=1e-4, abs=1e-6)
    for (name, a), (_, b) in zip(whole.model.named_parameters(), split.model.named_parameters(), strict=True):
        assert torch.allclose(a, b, atol=1e-6), name
    for key in ("reward_mean", "reward_std", "accuracy", "rejection_rate", "token_mask_rate", "xi_mean",
                "kl_old_sampler", "kv_saved", "staleness", "grad_norm"):
        assert key in m_whole
    assert m_whole["step"] == 1 and m_whole["sequences"] == 12 and m_whole["updates"] == 4


def test_step_changes_a_sparse_set_of_bf16_weights_and_the_patch_is_exact(
    tiny_model_dir: str, tmp_path: Path
) -> None:
    trainer = _trainer(tiny_model_dir, tmp_path, lr=1e-5)
    before = {k: v.clone() for k, v in trainer.learner.full_published().items()}
    assert "lm_head.weight" not in before  # tied: listed once, as save_pretrained does
    assert fingerprint(before) == fingerprint(published_state(trainer.learner.model))
    assert trainer.learner.published_fingerprint == fingerprint(before)
    trainer.train_step(_trajectories(vocab=90))
    after = published_state(trainer.learner.model)
    captured = trainer.learner.capture(full_state=True)
    patch = captured.make_patch("r", 0, 1)
    assert patch == extract_patch(before, after, run="r", base_version=0, target_version=1,
                                  encoding=trainer.settings.publish.encoding)
    assert captured.fingerprint == fingerprint(after) == trainer.learner.published_fingerprint
    assert captured.state is not None and fingerprint(captured.state) == fingerprint(after)
    header = read_header(patch)
    assert 0 < header.changed < trainer.numel  # something moved, not everything
    replica = {k: v.clone() for k, v in before.items()}
    apply_patch(replica, patch)
    assert fingerprint(replica) == fingerprint(after)
    assert all(torch.equal(replica[k].view(torch.int16), after[k].view(torch.int16)) for k in after)
    # The next capture is against these weights: nothing moved, nothing changes.
    assert read_header(trainer.learner.capture().make_patch("r", 1, 2)).changed == 0


def test_batch_gain_is_positive_for_a_descent_step_and_negative_for_ascent(
    tiny_model_dir: str, tmp_path: Path
) -> None:
    trajectories = _trajectories(vocab=90)
    assert "batch_gain" not in _learner(tiny_model_dir, tmp_path / "off").train_step(trajectories)
    descent = _learner(tiny_model_dir, tmp_path / "d", lr=1e-4, measure_batch_gain=True).train_step(
        trajectories
    )
    assert descent["batch_gain"] > 0
    # A negative learning rate walks up the loss: the metric must see the policy move the wrong way.
    ascent = _learner(tiny_model_dir, tmp_path / "a", lr=1e-4, measure_batch_gain=True)
    for group in ascent.optimizer.param_groups:
        group["lr"] = -1e-4
    assert ascent.train_step(trajectories)["batch_gain"] < 0


@pytest.mark.gpu
def test_a_step_runs_on_cuda(tiny_model_dir: str, tmp_path: Path) -> None:
    learner = _learner(
        tiny_model_dir, tmp_path, device="cuda", lr=1e-4, measure_batch_gain=True, loss={"kl_coef": 0.01}
    )
    metrics = learner.train_step(_trajectories(vocab=90))
    assert math.isfinite(metrics["loss"]) and metrics["batch_gain"] > 0


def test_ppo_updates_move_the_ratio_so_the_clip_acts(tiny_model_dir: str, tmp_path: Path) -> None:
    trajectories = _trajectories(vocab=90)
    one = _learner(tiny_model_dir, tmp_path / "one", lr=3e-3, ppo_updates=1)
    metrics = one.train_step(trajectories)
    # One update on the whole batch: the ratio is exactly 1 when the loss is taken.
    assert metrics["updates"] == 1 and metrics["clip_fraction"] == 0.0
    four = _learner(tiny_model_dir, tmp_path / "four", lr=3e-3, ppo_updates=4)
    metrics = four.train_step(trajectories)
    assert metrics["updates"] == 4 and metrics["clip_fraction"] > 0
    steps = {int(state["step"]) for state in four.optimizer.state.values()}
    assert steps == {4}  # four AdamW steps on every parameter


def test_kl_reference_is_the_frozen_starting_policy(tiny_model_dir: str, tmp_path: Path) -> None:
    trajectories = _trajectories(vocab=90)
    plain = _learner(tiny_model_dir, tmp_path / "plain", lr=1e-3)
    assert plain.ref_model is None and "kl_ref" not in plain.train_step(trajectories)
    learner = _learner(tiny_model_dir, tmp_path / "kl", lr=1e-3, loss={"kl_coef": 0.1})
    ref_before = {k: v.clone() for k, v in learner.ref_model.state_dict().items()}
    first = learner.train_step(trajectories)
    second = learner.train_step(trajectories)
    assert 0 <= first["kl_ref"] < second["kl_ref"]  # the policy drifts away from the anchor
    assert all(torch.equal(ref_before[k], v) for k, v in learner.ref_model.state_dict().items())
    assert not any(p.requires_grad for p in learner.ref_model.parameters())


def test_correction_metrics_split_by_staleness(tiny_model_dir: str, tmp_path: Path) -> None:
    trajectories = _trajectories(vocab=90)
    trajectories[0] = trajectories[0].model_copy(update={"policy_version": 2})
    metrics = _learner(tiny_model_dir, tmp_path).train_step(trajectories, version=2)
    assert metrics["staleness"] == {"0": 1, "2": 2}
    split = metrics["by_staleness"]
    assert split["0"]["sequences"] == 4 and split["2"]["sequences"] == 8
    assert set(split["0"]) == {"xi_mean", "kl_old_sampler", "rejection_rate", "divergent_rate",
                               "token_mask_rate", "sequences", "kv_saved", "kv_saved_per_token"}
    # The KV each version's samplers saved (the controller's floor, kv_budget rule 5): 1 − peak / tokens,
    # and every sequence here evicted, so one more token of budget costs at most sequences / tokens.
    for lag, rows in (("0", trajectories[:1]), ("2", trajectories[1:])):  # lag 0: sampled at v2
        samples = [s for t in rows for s in t.samples]
        tokens = sum(len(s.prompt_ids) + len(s.completion_ids) for s in samples)
        peak = sum(s.kv.peak_tokens for s in samples)
        assert split[lag]["kv_saved"] == pytest.approx(1 - peak / tokens)
        assert split[lag]["kv_saved_per_token"] == pytest.approx(len(samples) / tokens)
    dense = [t.model_copy(update={"samples": [s.model_copy(update={"kv": KVStats()}) for s in t.samples]})
             for t in trajectories]  # samplers that report no cache: no KV figures
    assert "kv_saved" not in _learner(tiny_model_dir, tmp_path / "d").train_step(
        dense, version=2)["by_staleness"]["0"]


def test_the_patch_encoding_is_a_setting(tiny_model_dir: str, tmp_path: Path) -> None:
    """zstd (the default) codes values/bitdelta only; ctxans is what the setting asks for, and
    both apply to the same exact weights."""
    for encoding, allowed in (("zstd", {"values", "bitdelta"}), ("ctxans", {"ctxans"})):
        publish = PublishSettings(encoding=encoding)
        learner = _learner(tiny_model_dir, tmp_path / encoding, lr=1e-5, publish=publish)
        before = {k: v.clone() for k, v in learner.full_published().items()}
        learner.train_step(_trajectories(vocab=90))
        patch = learner.capture().make_patch("r", 0, 1)
        used = {t.encoding for t in read_header(patch).tensors if t.count}
        assert used and used <= allowed, used
        state = {k: v.clone() for k, v in before.items()}
        apply_patch(state, patch)
        assert fingerprint(state) == learner.published_fingerprint


def test_trainer_refuses_trajectories_sampled_otherwise(tiny_model_dir: str, tmp_path: Path,
                                                        monkeypatch: pytest.MonkeyPatch) -> None:
    # The sampling contract alone: these synthetic groups were never admitted (admission's own
    # tests: tests/unit/services/trainer/test_admission.py and the forged-trajectory tests).
    monkeypatch.setattr("services.trainer.core.refusal", lambda *args, **kwargs: None)
    trainer = _trainer(tiny_model_dir, tmp_path, sampling=SamplingSettings(temperature=1.0))
    good = _trajectories(vocab=90, groups=1)[0].model_copy(update={"sampling": SamplingInfo(temperature=1.0)})
    assert trainer.sampling_mismatch(good) is None
    hot = good.model_copy(update={"sampling": SamplingInfo(temperature=0.7)})
    nucleus = good.model_copy(update={"sampling": SamplingInfo(temperature=1.0, top_p=0.9)})
    unknown = good.model_copy(update={"sampling": None})
    assert "temperature 0.7" in trainer.sampling_mismatch(hot)
    assert "top_p=0.9" in trainer.sampling_mismatch(nucleus)
    assert "did not report" in trainer.sampling_mismatch(unknown)
    accepted = [t for t in (good, hot, nucleus, unknown, hot) if trainer._accept(t)]
    assert accepted == [good] and sum(trainer.refused.values()) == 4 and len(trainer.refused) == 3
    metrics = trainer.train_step([good])
    assert metrics["refused_trajectories"] == 4
    assert trainer.train_step([good])["refused_trajectories"] == 0


def test_heldout_evaluation_is_repeatable_and_reported_on_schedule(
    tiny_model_dir: str, tmp_path: Path
) -> None:
    trainer = _trainer(tiny_model_dir, tmp_path, eval_every=2, eval_prompts=8)
    rng = torch.get_rng_state()
    first, again = trainer.evaluate(), trainer.evaluate()
    assert first == again  # fixed prompts and sampling seed
    assert torch.equal(torch.get_rng_state(), rng)  # the trainer's own random stream is untouched
    assert set(first) == {"heldout_accuracy", "heldout_reward"} and 0 <= first["heldout_reward"] <= 1
    trajectories = _trajectories(vocab=90)
    assert "heldout_accuracy" not in trainer.train_step(trajectories)  # step 1
    assert "heldout_accuracy" in trainer.train_step(trajectories)  # step 2


def test_heldout_prompts_are_made_with_the_eval_task_options(tiny_model_dir: str, tmp_path: Path) -> None:
    trainer = _trainer(tiny_model_dir, tmp_path, eval_prompts=4, eval_task_options={"scratchpad": "column"})
    seen = []
    trainer.learner.evaluate = lambda tokenizer, task, prompts, seed: (  # type: ignore[method-assign]
        seen.append(task) or {"accuracy": 0.0, "mean_reward": 0.0})
    trainer.evaluate()
    assert isinstance(seen[0], AdditionTask) and seen[0].scratchpad == "column"


def test_cpu_that_emulates_bf16_trains_in_fp32(tiny_model_dir: str, tmp_path: Path,
                                               monkeypatch: pytest.MonkeyPatch) -> None:
    """Where shared.dtypes finds bf16 products only emulated, autocast is off whatever the setting
    says, the bf16-saved KL reference is upcast (exactly), and a step still trains."""
    import services.trainer.learner as learner_module

    monkeypatch.setattr(learner_module, "compute_dtype", lambda device, dtype: torch.float32)
    learner = _learner(tiny_model_dir, tmp_path, loss={"kl_coef": 0.1})
    assert learner.config.bf16_autocast and not learner.bf16
    with learner._autocast():
        assert not torch.is_autocast_enabled("cpu")
    assert learner.ref_model is not None
    assert {p.dtype for p in learner.ref_model.parameters()} == {torch.float32}
    saved = {n: p.float() for n, p in
             type(learner.ref_model).from_pretrained(tiny_model_dir).named_parameters()}
    assert all(torch.equal(p, saved[n]) for n, p in learner.ref_model.named_parameters())
    metrics = learner.train_step(_trajectories(vocab=learner.model.config.vocab_size))
    assert math.isfinite(metrics["loss"])
