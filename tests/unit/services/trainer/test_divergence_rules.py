"""CorrectionConfig.divergence_rule: what a sequence loses for a token the dense policy would rarely
have sampled (ξ < mask_low)."""

from __future__ import annotations

import math

import pytest
import torch

from services.trainer.loss import CorrectionConfig, sparse_rl_corrections

# Four sequences of 5 completion tokens; ξ per token (the sampler's log-prob is 0, so log ξ is the
# dense log-prob). Row 1 diverges at token 2 (ξ 0.2), row 3 at token 3; rows 0 and 2 never do.
XI = torch.tensor([[1.0, 1.0, 1.0, 1.0, 1.0],
                   [1.0, 1.0, 0.2, 1.0, 1.0],
                   [1.0, 1.2, 1.0, 0.9, 1.0],
                   [1.0, 1.0, 1.0, 0.3, 1.0]])
MASK = torch.ones_like(XI, dtype=torch.bool)
ADV = torch.tensor([1.0, -1.0, -1.0, 1.0])  # row 1 diverged and lost; row 3 diverged and won


def _kept(rule: str, advantages: torch.Tensor | None = ADV) -> torch.Tensor:
    cfg = CorrectionConfig(divergence_rule=rule)  # type: ignore[arg-type]
    return sparse_rl_corrections(XI.log(), torch.zeros_like(XI), MASK, cfg, advantages).keep_token


def test_token_rule_masks_the_divergent_tokens_only() -> None:
    kept = _kept("token")
    assert kept.sum() == 18 and not kept[1, 2] and not kept[3, 3] and kept[1, 3:].all()


def test_veto_drops_every_divergent_sequence() -> None:
    cfg = CorrectionConfig(divergence_rule="veto")
    c = sparse_rl_corrections(XI.log(), torch.zeros_like(XI), MASK, cfg, ADV)
    assert c.keep_seq.tolist() == [True, False, True, False]
    assert c.metrics["rejection_rate"] == 0.5 and c.metrics["divergent_rate"] == 0.5


def test_veto_negative_drops_only_divergent_losers() -> None:
    kept = _kept("veto_negative")
    assert kept.any(dim=1).tolist() == [True, False, True, True]
    assert kept[3].tolist() == [True, True, True, False, True]  # the winner keeps the token rule
    # Without advantages nothing counts as negative: the token rule.
    assert torch.equal(_kept("veto_negative", None), _kept("token"))


def test_truncate_negative_keeps_a_losers_prefix() -> None:
    kept = _kept("truncate_negative")
    assert kept[1].tolist() == [True, True, False, False, False]
    assert kept[3].tolist() == [True, True, True, False, True]
    assert kept[2].all() and kept[0].all()


@pytest.mark.parametrize("rule", ["token", "veto", "veto_negative", "truncate_negative"])
def test_rules_agree_when_nothing_diverges(rule: str) -> None:
    xi = torch.full((3, 4), 1.1)
    c = sparse_rl_corrections(xi.log(), torch.zeros_like(xi), torch.ones_like(xi, dtype=torch.bool),
                              CorrectionConfig(divergence_rule=rule), torch.tensor([1.0, -1.0, 0.0]))  # type: ignore[arg-type]
    assert c.keep_token.all() and c.metrics["divergent_rate"] == 0.0
    assert math.isclose(float(c.weight.mean()), 1.0, rel_tol=1e-6)


def test_the_default_rule_vetoes_divergent_losers_only() -> None:
    """The trainer's default (docs/training.md, "Rejection rules"): row 1 diverged and lost, so it goes;
    row 3 diverged and won, so it keeps every token but the divergent one."""
    c = sparse_rl_corrections(XI.log(), torch.zeros_like(XI), MASK, CorrectionConfig(), ADV)
    assert c.keep_seq.tolist() == [True, False, True, True]
    assert c.metrics["rejection_rate"] == 0.25 and c.metrics["divergent_rate"] == 0.5
    assert torch.equal(c.keep_token, _kept("veto_negative"))


def test_divergence_judged_by_other_log_probs() -> None:
    """`logp_divergence` (LossConfig.divergence_against = "dense" under replay): the rule's divergent
    tokens come from those log-probs, while ξ, the token mask and the weights stay the recompute's."""
    replayed = torch.ones_like(XI)  # the replayed recompute matches the sampler: ξ = 1 everywhere
    cfg = CorrectionConfig(divergence_rule="veto_negative")
    alone = sparse_rl_corrections(replayed.log(), torch.zeros_like(XI), MASK, cfg, ADV)
    assert alone.keep_token.all() and alone.metrics["divergent_rate"] == 0.0
    judged = sparse_rl_corrections(replayed.log(), torch.zeros_like(XI), MASK, cfg, ADV,
                                   logp_divergence=XI.log())
    assert judged.keep_seq.tolist() == [True, False, True, True]  # the dense-divergent loser goes
    assert judged.keep_token[3].all()  # the winner keeps every token: the mask reads the recompute's ξ
    assert judged.metrics["divergent_rate"] == 0.5 and judged.metrics["rejection_rate"] == 0.25
    assert torch.equal(judged.xi, alone.xi)
