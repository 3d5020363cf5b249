"""GRPO advantages, Sparse-RL corrections and the PPO-clip loss against hand-computed values."""

import math

import pytest
import torch

from services.trainer.loss import (
    CorrectionConfig,
    LossConfig,
    grpo_advantages,
    grpo_loss,
    sparse_rl_corrections,
)

OFF = CorrectionConfig(sequence_veto=False, token_mask=False, token_weight=False)
LN = math.log


def test_advantages_group_normalised_unbiased_std():
    rewards = torch.tensor([1.0, 0.0, 2.0, 2.0, 2.0, 5.0, 0.0, 0.0, 3.0])
    groups = torch.tensor([7, 7, 3, 3, 3, 9, 4, 4, 4])
    adv = grpo_advantages(rewards, groups)
    s = 1 / math.sqrt(3)
    want = [1 / math.sqrt(2), -1 / math.sqrt(2), 0, 0, 0, 0, -s, -s, 2 * s]
    assert adv.tolist() == pytest.approx(want, abs=1e-5)


@pytest.mark.gpu
def test_advantages_on_cuda_match_cpu():
    """The trainer's batch lives on its device; the per-group sums must be built there too."""
    rewards = torch.tensor([1.0, 0.0, 0.5, 0.2, 0.2, 0.9, 0.1])
    groups = torch.tensor([0, 0, 0, 4, 4, 7, 7])
    cpu = grpo_advantages(rewards, groups)
    cuda = grpo_advantages(rewards.cuda(), groups.cuda())
    assert cuda.device.type == "cuda"
    assert torch.allclose(cuda.cpu(), cpu, atol=1e-6)

def test_advantages_zero_variance_and_empty():
    assert grpo_advantages(torch.tensor([0.3, 0.3]), torch.tensor([0, 0])).tolist() == [0.0, 0.0]
    assert grpo_advantages(torch.tensor([]), torch.tensor([], dtype=torch.long)).numel() == 0


def _hand_batch():
    # Position 0 is prompt. log ξ per completion token:
    #   seq0: 0, ln 2, ln 0.8      → ξ = 1, 2 (masked: > 1.5), 0.8
    #   seq1: ln 1e-5, 0, 0        → vetoed (1e-5 < 1e-4)
    #   seq2: ln 1.2, ln 0.6, pad  → ξ = 1.2, 0.6
    log_xi = torch.tensor(
        [[0.0, 0.0, LN(2), LN(0.8)], [0.0, LN(1e-5), 0.0, 0.0], [0.0, LN(1.2), LN(0.6), 0.0]]
    )
    mask = torch.tensor([[0, 1, 1, 1], [0, 1, 1, 1], [0, 1, 1, 0]])
    logp_sampler = torch.full((3, 4), -2.0)
    return logp_sampler + log_xi, logp_sampler, mask


def test_corrections_hand_example():
    old, sampler, mask = _hand_batch()
    c = sparse_rl_corrections(old, sampler, mask, CorrectionConfig())
    assert c.keep_seq.tolist() == [True, False, True]
    assert c.has_tokens.tolist() == [True, True, True]
    assert c.keep_token.tolist() == [[False, True, False, True], [False] * 4, [False, True, True, False]]
    # Sparse-RL normalises min(ξ, 1.5) over every response token, masked and vetoed ones included:
    # 1, 1.5, 0.8, 1e-5, 1, 1, 1.2, 0.6 → mean 7.10001 / 8
    mean = (1 + 1.5 + 0.8 + 1e-5 + 1 + 1 + 1.2 + 0.6) / 8
    assert c.weight[0].tolist() == pytest.approx([0, 1 / mean, 0, 0.8 / mean], abs=1e-6)
    assert c.weight[1].tolist() == [0.0] * 4
    assert c.weight[2].tolist() == pytest.approx([0, 1.2 / mean, 0.6 / mean, 0], abs=1e-6)
    m = c.metrics
    assert m["rejection_rate"] == pytest.approx(1 / 3)
    assert m["token_mask_rate"] == pytest.approx(1 / 5)  # 1 of the 5 tokens of kept sequences
    assert m["xi_mean"] == pytest.approx((1 + 2 + 0.8 + 1e-5 + 1 + 1 + 1.2 + 0.6) / 8, abs=1e-6)
    k = [x * math.log(x) - x + 1 for x in (1, 2, 0.8, 1e-5, 1, 1, 1.2, 0.6)]
    assert m["kl_old_sampler"] == pytest.approx(sum(k) / 8, abs=1e-5)
    # Normalised over the kept tokens instead: kept ξ = 1, 0.8, 1.2, 0.6 (mean 0.9) → weights / 0.9
    kept = sparse_rl_corrections(old, sampler, mask, CorrectionConfig(normalize_over="kept"))
    assert kept.weight[0].tolist() == pytest.approx([0, 1 / 0.9, 0, 0.8 / 0.9], abs=1e-6)
    assert kept.weight[2].tolist() == pytest.approx([0, 1.2 / 0.9, 0.6 / 0.9, 0], abs=1e-6)
    assert float(kept.weight[kept.keep_token].mean()) == pytest.approx(1.0, abs=1e-6)
    assert c.normalizer("token_mean").item() == 4 and c.normalizer("seq_mean_token_mean").item() == 3


def test_sequence_mean_aggregation_hand_example():
    """Sparse-RL's aggregation: mean over each sequence's kept tokens, then over all sequences,
    the vetoed one counting as 0; token_mean divides the kept tokens' sum by their count."""
    old, sampler, mask = _hand_batch()
    new = old.clone().requires_grad_()  # ratio 1: ℓ_t = −w_t·A
    adv = torch.tensor([1.0, 1.0, -2.0])
    cfg = LossConfig()
    c = sparse_rl_corrections(old, sampler, mask, cfg.corrections)
    w = c.weight
    seq0 = -(w[0, 1] + w[0, 3]) / 2
    seq2 = 2 * (w[2, 1] + w[2, 2]) / 2
    loss, _ = grpo_loss(new, old, sampler, adv, mask, cfg)
    assert loss.item() == pytest.approx(float((seq0 + 0 + seq2) / 3), abs=1e-6)
    token, _ = grpo_loss(new, old, sampler, adv, mask, cfg.model_copy(update={"aggregation": "token_mean"}))
    assert token.item() == pytest.approx(
        float((-(w[0, 1] + w[0, 3]) + 2 * (w[2, 1] + w[2, 2])) / 4), abs=1e-6
    )
    # Split over micro-batches with the whole batch's normalizer: the same loss.
    parts = [grpo_loss(new[r], old[r], sampler[r], adv[r], mask[r], cfg, corrections=c.rows(r),
                       normalizer=c.normalizer(cfg.aggregation))[0] for r in (slice(0, 1), slice(1, 3))]
    assert sum(p.item() for p in parts) == pytest.approx(loss.item(), abs=1e-6)


def test_weights_capped_and_normalised_without_token_mask():
    old = torch.tensor([[0.0, LN(3), LN(0.25), 0.0]])
    c = sparse_rl_corrections(
        old, torch.zeros(1, 4), torch.tensor([[0, 1, 1, 1]]), CorrectionConfig(token_mask=False)
    )
    raw = [1.5, 0.25, 1.0]  # min(ξ, 1.5)
    assert c.weight[0, 1:].tolist() == pytest.approx([w / (sum(raw) / 3) for w in raw], abs=1e-6)
    unnormalised = sparse_rl_corrections(old, torch.zeros(1, 4), torch.tensor([[0, 1, 1, 1]]),
                                         CorrectionConfig(token_mask=False, normalize_weights=False))
    assert unnormalised.weight[0, 1:].tolist() == pytest.approx(raw, abs=1e-6)


def test_xi_extremes_are_clamped_not_nan():
    inf = float("inf")
    # token 1: sampler said impossible (log ξ = +inf → e^20, masked); token 2 of seq1: old dense
    # said impossible (log ξ = −inf → e^−20, vetoed); token 3 of seq0: both −inf (nan → ξ = 1).
    old = torch.tensor([[0.0, -1.0, -1.0, -inf], [0.0, -1.0, -inf, -1.0]])
    sampler = torch.tensor([[0.0, -inf, -1.0, -inf], [0.0, -1.0, -1.0, -1.0]])
    mask = torch.tensor([[0, 1, 1, 1], [0, 1, 1, 1]])
    c = sparse_rl_corrections(old, sampler, mask, CorrectionConfig())
    assert c.xi[0, 1] == pytest.approx(math.exp(20), rel=1e-5)
    assert c.xi[1, 2] == pytest.approx(math.exp(-20), rel=1e-5)
    assert c.xi[0, 3] == 1.0
    assert c.keep_seq.tolist() == [True, False]
    assert c.keep_token[0].tolist() == [False, False, True, True]
    assert all(math.isfinite(v) for v in c.metrics.values())


def test_ppo_clip_hand_example_and_grad():
    # ratio = 1.5 (clipped to 1.2) and 0.9; A = +1 → loss = −(1.2 + 0.9) / 2
    old = torch.tensor([[0.0, -1.0, -2.0]])
    new = (old + torch.tensor([[0.0, LN(1.5), LN(0.9)]])).requires_grad_()
    mask = torch.tensor([[0, 1, 1]])
    loss, m = grpo_loss(new, old, old, torch.tensor([1.0]), mask, LossConfig(corrections=OFF))
    assert loss.item() == pytest.approx(-1.05, abs=1e-6)
    loss.backward()
    # clipped token has no gradient; d/dlogp of −r·A/2 = −0.45 on the other
    assert new.grad[0].tolist() == pytest.approx([0.0, 0.0, -0.45], abs=1e-6)
    assert m["clip_fraction"] == pytest.approx(0.5)
    # A = −1: the pessimistic branch is the unclipped 1.5 → loss = (1.5 + 0.9) / 2
    loss, _ = grpo_loss(new, old, old, torch.tensor([-1.0]), mask, LossConfig(corrections=OFF))
    assert loss.item() == pytest.approx(1.2, abs=1e-6)


def test_switches_off_is_plain_token_mean_grpo():
    torch.manual_seed(0)
    old = torch.randn(3, 5) - 2
    sampler = old + torch.randn(3, 5)  # large gaps: corrections would change everything if on
    new = (old + 0.1 * torch.randn(3, 5)).requires_grad_()
    adv = torch.tensor([0.5, -1.0, 2.0])
    mask = torch.tensor([[0, 1, 1, 1, 0], [0, 0, 1, 1, 1], [0, 1, 1, 1, 1]])
    loss, m = grpo_loss(new, old, sampler, adv, mask, LossConfig(corrections=OFF, aggregation="token_mean"))
    ratio = (new - old).exp()
    per = -torch.minimum(ratio * adv[:, None], ratio.clamp(0.8, 1.2) * adv[:, None])
    expected = ((per * mask).sum() / mask.sum()).detach()
    assert loss.detach().item() == pytest.approx(expected.item(), abs=1e-6)
    assert m["rejection_rate"] == 0.0 and m["token_mask_rate"] == 0.0
    corrected, _ = grpo_loss(new, old, sampler, adv, mask, LossConfig(aggregation="token_mean"))
    assert corrected.detach().item() != pytest.approx(loss.detach().item(), abs=1e-4)
    # The default sequence-mean aggregation: each sequence's token mean, then their mean.
    seq_mean, _ = grpo_loss(new, old, sampler, adv, mask, LossConfig(corrections=OFF))
    want = ((per * mask).sum(dim=1) / mask.sum(dim=1)).mean()
    assert seq_mean.detach().item() == pytest.approx(want.detach().item(), abs=1e-6)


def test_empty_batch_after_rejection_keeps_grad_path():
    old = torch.tensor([[0.0, -1.0, -30.0], [0.0, -40.0, -1.0]])  # every sequence has ξ < 1e-4
    sampler = torch.tensor([[0.0, -1.0, -1.0], [0.0, -1.0, -1.0]])
    new = old.clone().requires_grad_()
    loss, m = grpo_loss(new, old, sampler, torch.tensor([1.0, -1.0]), torch.tensor([[0, 1, 1], [0, 1, 1]]),
                        LossConfig(kl_coef=0.1), logp_ref=old)
    assert loss.item() == 0.0 and loss.requires_grad
    loss.backward()
    assert torch.equal(new.grad, torch.zeros_like(new))
    assert m["rejection_rate"] == 1.0 and m["kept_tokens"] == 0.0
    assert all(math.isfinite(v) for v in m.values())


def test_all_tokens_masked():
    old = torch.tensor([[0.0, LN(3.0), LN(0.3)]])  # ξ = 3 and 0.3: both outside [0.5, 1.5], neither vetoed
    new = old.clone().requires_grad_()
    loss, m = grpo_loss(
        new, old, torch.zeros(1, 3), torch.tensor([1.0]), torch.tensor([[0, 1, 1]]), LossConfig()
    )
    loss.backward()
    assert loss.item() == 0.0 and torch.equal(new.grad, torch.zeros_like(new))
    assert m["token_mask_rate"] == 1.0 and m["rejection_rate"] == 0.0


def test_corrections_weight_the_token_loss():
    # One sequence, two kept tokens with ξ = 1.2 and 0.8 (mean 1 already), ratio 1, A = 1:
    # loss = −(1.2·1 + 0.8·1) / 2 = −1, gradient per token = −w/2.
    sampler = torch.tensor([[0.0, -1.0, -1.0]])
    old = sampler + torch.tensor([[0.0, LN(1.2), LN(0.8)]])
    new = old.clone().requires_grad_()
    loss, _ = grpo_loss(new, old, sampler, torch.tensor([1.0]), torch.tensor([[0, 1, 1]]), LossConfig())
    loss.backward()
    assert loss.item() == pytest.approx(-1.0, abs=1e-6)
    assert new.grad[0, 1:].tolist() == pytest.approx([-0.6, -0.4], abs=1e-6)


def test_k3_kl_to_reference():
    old = torch.tensor([[0.0, -1.0]])
    ref = old + torch.tensor([[0.0, LN(2.0)]])
    k3 = 2.0 - LN(2.0) - 1.0
    loss, m = grpo_loss(old.clone(), old, old, torch.tensor([0.0]), torch.tensor([[0, 1]]),
                        LossConfig(kl_coef=0.5, corrections=OFF), logp_ref=ref)
    assert m["kl_ref"] == pytest.approx(k3, abs=1e-6)
    assert loss.item() == pytest.approx(0.5 * k3, abs=1e-6)


def test_kl_term_is_not_weighted_by_xi():
    """ξ weights scale the policy-gradient term only (Sparse-RL's loss): with A = 0 the loss is the
    plain k3 mean even when the kept token's weight is far from 1."""
    sampler = torch.tensor([[0.0, -1.0, -1.0]])
    old = sampler + torch.tensor([[0.0, LN(1.4), LN(0.6)]])  # both kept, weights 1.4/x and 0.6/x
    ref = old + torch.tensor([[0.0, LN(2.0), LN(2.0)]])
    k3 = 2.0 - LN(2.0) - 1.0
    loss, m = grpo_loss(old.clone(), old, sampler, torch.tensor([0.0]), torch.tensor([[0, 1, 1]]),
                        LossConfig(kl_coef=0.5), logp_ref=ref)
    assert m["kl_ref"] == pytest.approx(k3, abs=1e-6)
    assert loss.item() == pytest.approx(0.5 * k3, abs=1e-6)
