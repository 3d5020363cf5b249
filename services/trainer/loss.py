"""GRPO with Sparse-RL corrections: advantages, rejection sampling / reweighting, PPO-clip loss.

Pure torch, no model code. Shapes: B sequences × L token positions; every per-token tensor is
aligned with the sequence tokens and `mask` marks completion tokens (1) vs prompt/padding (0).

The three log-probs per token (source: Sparse-RL, arXiv 2601.10079, `mis.py`; see
../../docs/training.md):
  logp_sampler    what the rollout engine sampled from, with its compressed KV cache
  logp_old_dense  the same policy version recomputed by the trainer with the full (dense) cache
  logp_new        the policy being optimised (requires grad)

ξ_t = π_old_dense/π_sampler corrects the off-policy gap that KV compression creates; the PPO ratio
π_θ/π_old_dense is kept separate from it.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Literal

import torch
from pydantic import BaseModel, Field


class CorrectionConfig(BaseModel):
    """Sparse-RL correction switches and constants (defaults: Sparse-RL `mis.py` but `divergence_rule`)."""

    log_ratio_clamp: float = Field(20.0, gt=0, description="clamp of log ξ before exp")
    sequence_veto: bool = True
    veto_threshold: float = Field(1e-4, ge=0, description="drop a sequence if any token's ξ is below")
    token_mask: bool = True
    mask_low: float = 0.5
    mask_high: float = 1.5
    token_weight: bool = True
    weight_cap: float = Field(1.5, gt=0, description="w = min(ξ, cap)")
    normalize_weights: bool = True  # rescale w to mean 1 over the batch
    # The tokens that mean is taken over: "response" = every completion token of the batch, masked
    # and vetoed ones included (Sparse-RL's `mis.py`, `tis_batch_normalize`); "kept" = survivors only.
    normalize_over: Literal["response", "kept"] = "response"
    # What a sequence loses for a *divergent* token, one the dense policy would rarely have sampled
    # (ξ < mask_low), beyond that token's own mask (docs/training.md, "Rejection rules"):
    #   token               nothing more (Sparse-RL's mis.py)
    #   veto                the whole sequence
    #   veto_negative       the whole sequence if its advantage is negative: its low reward may be the
    #                       sampler's doing, and its later tokens would push the dense policy away from
    #                       continuations it had right
    #   truncate_negative   a negative-advantage sequence keeps only the tokens before its first divergence
    # Default veto_negative: on a GPU grid it kept the dense policy closest to dense RL's in three
    # cells of four (the authors' rule ended 17 points below dense in one where a third of the
    # sequences diverged but 3 % were vetoed); "token" stays for the authors' behaviour.
    divergence_rule: Literal["token", "veto", "veto_negative", "truncate_negative"] = "veto_negative"


# How token losses become the batch loss. "seq_mean_token_mean" (Sparse-RL's slime default,
# `sum_of_sample_mean`): each sequence's mean over its kept tokens, then the mean over the batch's
# sequences, a vetoed sequence counting as 0. "token_mean": the mean over every kept token.
Aggregation = Literal["seq_mean_token_mean", "token_mean"]


class LossConfig(BaseModel):
    clip_eps: float = Field(0.2, ge=0)
    kl_coef: float = Field(0.0, ge=0, description="weight of the k3 KL to the reference policy")
    aggregation: Aggregation = "seq_mean_token_mean"
    corrections: CorrectionConfig = Field(default_factory=CorrectionConfig)
    # No update without evidence (docs/training.md, "No update without evidence"). AdamW moves the
    # weights by ~lr whatever the loss's scale, and along its momentum (plus weight decay) even with
    # a zero gradient: so a minibatch with fewer surviving sequences than this takes no optimizer
    # step at all, and one with survivors takes a step of lr × their share of its sequences, or the
    # full lr once that share reaches `full_step_share` (lr × share / full_step_share below it).
    min_surviving_sequences: int = Field(1, ge=1, description="survivors a minibatch needs for a step")
    scale_lr_by_survivors: bool = True
    full_step_share: float = Field(1.0, gt=0, le=1, description="surviving share from which the step is full")
    # How the trainer computes the old and new policies' log-probs (docs/training.md, "Eviction
    # replay"): "dense" with a full cache (Sparse-RL: ξ corrects the sampler's compression);
    # "replayed" under the attention the sampler's compressed cache gave each token, replayed by
    # the rollout engine, so the policy is trained as it samples (ξ then only carries weight lag).
    recompute: Literal["dense", "replayed"] = "dense"
    # Which old log-probs judge a token divergent (ξ < mask_low) for `divergence_rule`: the
    # recompute's ("recompute"), or a dense recompute's ("dense": one more no-grad forward under
    # replay). Under replay the recompute matches the sampler, so its ξ finds almost no divergence
    # and the rule never acts; judged against a dense cache, a loser the cache broke is still vetoed
    # while the tokens kept are trained as the sampler ran (docs/training.md, "Eviction replay").
    divergence_against: Literal["recompute", "dense"] = "recompute"


@dataclass(frozen=True)
class Corrections:
    xi: torch.Tensor  # [B, L] fp32, ξ on completion tokens, 1 elsewhere
    has_tokens: torch.Tensor  # [B] bool, the sequence has completion tokens
    keep_seq: torch.Tensor  # [B] bool, survived the veto
    keep_token: torch.Tensor  # [B, L] bool, completion token of a kept sequence inside the band
    weight: torch.Tensor  # [B, L] fp32, 0 on dropped tokens; normalised over the batch (normalize_over)
    metrics: dict[str, float]

    def rows(self, rows: slice | torch.Tensor) -> Corrections:
        """The corrections of some sequences (a slice or an index tensor); weights keep their
        batch-wide normalisation."""
        return Corrections(xi=self.xi[rows], has_tokens=self.has_tokens[rows], keep_seq=self.keep_seq[rows],
                           keep_token=self.keep_token[rows], weight=self.weight[rows], metrics=self.metrics)

    def surviving(self) -> torch.Tensor:
        """[B] bool: the sequence keeps at least one token (survived the veto and the mask)."""
        return self.keep_token.any(dim=1)

    def normalizer(self, aggregation: Aggregation) -> torch.Tensor:
        """What the summed loss of these sequences is divided by: their kept tokens (token mean)
        or their sequences with completion tokens, vetoed ones included (sequence mean)."""
        if aggregation == "token_mean":
            return self.keep_token.sum()
        return self.has_tokens.sum()


def grpo_advantages(rewards: torch.Tensor, group_ids: torch.Tensor, eps: float = 1e-6) -> torch.Tensor:
    """(r − mean_group) / (std_group + eps), std unbiased (n − 1) as in DeepSeekMath/TRL.

    Groups of one sample or with identical rewards carry no learning signal: their advantage is 0.
    `group_ids` are any integer labels; groups may have different sizes.
    """
    rewards = rewards.float()
    if rewards.numel() == 0:
        return rewards.clone()
    _, inverse = torch.unique(group_ids, return_inverse=True)
    groups = int(inverse.max()) + 1
    count = rewards.new_zeros(groups).index_add_(0, inverse, torch.ones_like(rewards))
    mean = rewards.new_zeros(groups).index_add_(0, inverse, rewards) / count
    centered = rewards - mean[inverse]
    sq = rewards.new_zeros(groups).index_add_(0, inverse, centered.square())
    std = (sq / (count - 1).clamp(min=1)).sqrt()
    adv = centered / (std[inverse] + eps)
    return torch.where(std[inverse] > eps, adv, torch.zeros_like(adv))


def _safe_mean(values: torch.Tensor, mask: torch.Tensor) -> float:
    n = mask.sum()
    return float((values * mask).sum() / n) if n > 0 else 0.0


XI_QUANTILES = (0.01, 0.1, 0.5, 0.9, 0.99)


def xi_quantiles(xi: torch.Tensor, mask: torch.Tensor) -> dict[str, float]:
    """`xi_p01` … `xi_p99`: quantiles of ξ over the completion tokens (1.0 when there are none)."""
    values = xi[mask].float()
    if values.numel() > 1 << 20:  # torch.quantile's input limit is 2^24; a strided subsample is plenty
        values = values[:: values.numel() // (1 << 20) + 1]
    if values.numel() == 0:
        return {f"xi_p{round(q * 100):02d}": 1.0 for q in XI_QUANTILES}
    qs = torch.quantile(values, torch.tensor(XI_QUANTILES, device=values.device)).tolist()
    return {f"xi_p{round(q * 100):02d}": v for q, v in zip(XI_QUANTILES, qs, strict=True)}


def sparse_rl_corrections(
    logp_old_dense: torch.Tensor, logp_sampler: torch.Tensor, mask: torch.Tensor, cfg: CorrectionConfig,
    advantages: torch.Tensor | None = None, logp_divergence: torch.Tensor | None = None,
) -> Corrections:
    """Sequence veto, token mask and token weights from ξ_t = exp(clamp(logp_old_dense − logp_sampler)),
    then `cfg.divergence_rule` (the *_negative rules need `advantages` [B]; without them no sequence
    counts as negative), its divergent tokens judged by `logp_divergence` in place of
    `logp_old_dense` when given (`LossConfig.divergence_against`).

    Metrics: `rejection_rate` (vetoed / sequences), `token_mask_rate` (masked / completion tokens of
    kept sequences), `xi_mean` (over all completion tokens), `kl_old_sampler` (KL(π_old_dense ‖
    π_sampler) per token, estimated from the sampler's tokens as mean of ξ·log ξ − ξ + 1: unbiased,
    since E_sampler[ξ log ξ] = KL and E_sampler[ξ − 1] = 0, and never negative).
    """
    mask = mask.bool()

    def log_ratio(logp_old: torch.Tensor) -> torch.Tensor:
        log_xi = (logp_old.detach().float() - logp_sampler.detach().float())
        log_xi = torch.nan_to_num(log_xi, nan=0.0).clamp(-cfg.log_ratio_clamp, cfg.log_ratio_clamp)
        return torch.where(mask, log_xi, torch.zeros_like(log_xi))

    log_xi = log_ratio(logp_old_dense)
    xi = log_xi.exp()
    xi_divergence = xi if logp_divergence is None else log_ratio(logp_divergence).exp()

    has_tokens = mask.any(dim=1)
    keep_seq = has_tokens
    if cfg.sequence_veto:
        keep_seq = keep_seq & ~((xi < cfg.veto_threshold) & mask).any(dim=1)
    divergent = mask & (xi_divergence < cfg.mask_low)
    diverged = divergent.any(dim=1)
    negative = torch.zeros_like(has_tokens) if advantages is None else (advantages < 0).to(mask.device)
    if cfg.divergence_rule == "veto":
        keep_seq = keep_seq & ~diverged
    elif cfg.divergence_rule == "veto_negative":
        keep_seq = keep_seq & ~(diverged & negative)
    in_seq = mask & keep_seq[:, None]
    keep_token = in_seq
    if cfg.divergence_rule == "truncate_negative":
        before_first = divergent.int().cumsum(dim=1) == 0
        keep_token = keep_token & (before_first | ~negative[:, None])
    if cfg.token_mask:
        keep_token = keep_token & (xi >= cfg.mask_low) & (xi <= cfg.mask_high)

    weight = keep_token.float()
    if cfg.token_weight:
        capped = xi.clamp(max=cfg.weight_cap)
        weight = weight * capped
        scope = mask if cfg.normalize_over == "response" else keep_token
        if cfg.normalize_weights and keep_token.any():
            weight = weight / capped[scope].mean()

    n_seq = int(has_tokens.sum())
    metrics = {
        "rejection_rate": float((has_tokens & ~keep_seq).sum()) / n_seq if n_seq else 0.0,
        "divergent_rate": float(diverged.sum()) / n_seq if n_seq else 0.0,  # sequences with ξ < mask_low
        "token_mask_rate": 1.0 - float(keep_token.sum()) / float(in_seq.sum()) if in_seq.any() else 0.0,
        "xi_mean": _safe_mean(xi, mask),
        "kl_old_sampler": _safe_mean(xi * log_xi - xi + 1.0, mask),
        "kept_tokens": float(keep_token.sum()),
        **xi_quantiles(xi, mask),
    }
    return Corrections(xi=xi, has_tokens=has_tokens, keep_seq=keep_seq, keep_token=keep_token, weight=weight,
                       metrics=metrics)


def grpo_loss(
    logp_new: torch.Tensor,
    logp_old_dense: torch.Tensor,
    logp_sampler: torch.Tensor,
    advantages: torch.Tensor,
    mask: torch.Tensor,
    cfg: LossConfig,
    logp_ref: torch.Tensor | None = None,
    corrections: Corrections | None = None,
    normalizer: torch.Tensor | float | None = None,
) -> tuple[torch.Tensor, dict[str, float]]:
    """PPO-clip GRPO loss × Sparse-RL weights over the surviving tokens, aggregated per `cfg.aggregation`.

    per token:  ℓ_t = −w_t·min(r_t A, clip(r_t, 1 ± ε) A) + β·k3_t,   r_t = π_θ/π_old_dense
                k3_t = exp(logp_ref − logp_new) − (logp_ref − logp_new) − 1   (Schulman's low-var KL)
    The KL term is not weighted by ξ (as in Sparse-RL's code). Aggregation:
      seq_mean_token_mean   Σ_i (Σ_t ℓ_it / n_kept_i) / N_seq   (vetoed sequences add 0, count in N_seq)
      token_mean            Σ_it ℓ_it / N_kept

    With every switch off and token_mean this is plain token-mean GRPO. When no token survives,
    the loss is an exact 0 that still depends on `logp_new`, so `backward()` leaves zero gradients.

    Micro-batching: compute `corrections` once over the whole batch (`sparse_rl_corrections`), pass
    each micro-batch its `corrections.rows(...)` and, as `normalizer`, the normalizer of all the
    sequences one optimizer step covers (`corrections.rows(those).normalizer(cfg.aggregation)`);
    the summed micro-batch losses then equal the loss of those sequences taken together.
    """
    corr = corrections or sparse_rl_corrections(logp_old_dense, logp_sampler, mask, cfg.corrections)
    keep = corr.keep_token
    logp_new = logp_new.float()
    # Zero the log-ratio on dropped positions before exp: padding may hold any value (even inf).
    log_ratio = torch.where(keep, logp_new - logp_old_dense.detach().float(), torch.zeros_like(logp_new))
    ratio = log_ratio.exp()
    adv = advantages.float()[:, None]
    unclipped = ratio * adv
    clipped = ratio.clamp(1.0 - cfg.clip_eps, 1.0 + cfg.clip_eps) * adv
    per_token = -torch.minimum(unclipped, clipped) * corr.weight

    metrics = dict(corr.metrics)
    if logp_ref is not None:
        ref_diff = torch.where(keep, logp_ref.detach().float() - logp_new, torch.zeros_like(logp_new))
        k3 = ref_diff.exp() - ref_diff - 1.0
        metrics["kl_ref"] = _safe_mean(k3.detach(), keep)
        if cfg.kl_coef:
            per_token = per_token + cfg.kl_coef * k3 * keep

    if cfg.aggregation == "token_mean":
        total = per_token.sum()
    else:
        total = (per_token.sum(dim=1) / keep.sum(dim=1).clamp(min=1)).sum()
    denominator = corr.normalizer(cfg.aggregation) if normalizer is None else torch.as_tensor(normalizer)
    loss = total / denominator.clamp(min=1)
    metrics["clip_fraction"] = _safe_mean(((ratio - 1.0).abs() > cfg.clip_eps).float().detach(), keep)
    metrics["ratio_mean"] = _safe_mean(ratio.detach(), keep)
    metrics["loss"] = float(loss.detach())
    return loss, metrics
