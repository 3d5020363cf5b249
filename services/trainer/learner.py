"""The learner: policy weights, optimizer and one GRPO + Sparse-RL update per rollout batch.

No Redis, no registry, no HTTP: the trainer service (core.py) feeds it trajectories and publishes
what it returns, and bench/learning.py drives it in-process with the same code. One call of
`train_step`:

1. recompute the dense old-policy log-probs of every sampled token (`logp_old_dense`) and, with a
   KL term, the frozen reference policy's;
2. Sparse-RL corrections from ξ = π_old_dense / π_sampler, once over the whole batch;
3. `ppo_updates` AdamW steps, each on a shuffled 1/N of the sequences (micro-batched), so the PPO
   ratio moves off 1 and the clip acts (Sparse-RL: 128 prompts × 8 samples, global batch 256 →
   4 updates per rollout).
"""

from __future__ import annotations

import contextlib
from collections.abc import Sequence
from pathlib import Path
from typing import Any

import torch
from transformers import AutoModelForCausalLM

from services.trainer.batching import TrainBatch, collate
from services.trainer.loss import Corrections, grpo_advantages, grpo_loss, sparse_rl_corrections
from services.trainer.rollout_math import token_logprobs
from services.trainer.settings import TrainerSettings
from shared.schemas import Trajectory

# Correction metrics reported per staleness (trainer version − sampling version): with staleness
# > 0, ξ mixes weight lag with KV sparsity, so the two are only comparable split this way.
_BY_STALENESS = ("xi_mean", "kl_old_sampler", "rejection_rate", "token_mask_rate")


def resolve_device(name: str) -> torch.device:
    if name == "auto":
        return torch.device("cuda" if torch.cuda.is_available() else "cpu")
    return torch.device(name)


def published_state(model: torch.nn.Module) -> dict[str, torch.Tensor]:
    """bf16 copies of the weights under the names HF's save_pretrained writes: a tied lm_head
    shares the embedding's storage and is listed once (the first name), like the rollout engines."""
    out: dict[str, torch.Tensor] = {}
    seen: set[int] = set()
    for name, tensor in model.state_dict().items():
        if tensor.data_ptr() in seen:
            continue
        seen.add(tensor.data_ptr())
        out[name] = tensor.detach().to(torch.bfloat16, copy=True)
    return out


class Learner:
    def __init__(self, settings: TrainerSettings, model_dir: Path, pad_id: int) -> None:
        self.settings = settings
        self.device = resolve_device(settings.device)
        self.pad_id = pad_id
        torch.manual_seed(settings.seed)
        self.model = AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32).to(self.device)
        self.model.config.use_cache = False
        self.optimizer = torch.optim.AdamW(self.model.parameters(), lr=settings.lr, weight_decay=settings.weight_decay,
                                           betas=(settings.beta1, settings.beta2))
        # The KL anchor: the starting weights (the warm start), frozen, in the dtype they were saved in.
        self.ref_model = None
        if settings.loss.kl_coef > 0:
            self.ref_model = AutoModelForCausalLM.from_pretrained(model_dir).to(self.device).eval()
            self.ref_model.requires_grad_(False)
        self.step = 0
        # Minibatch order: its own generator, so sampling elsewhere does not change which sequences
        # share an update (a checkpoint stores its state).
        self.shuffle = torch.Generator().manual_seed(settings.seed)

    # -- one update --

    def train_step(self, trajectories: Sequence[Trajectory], version: int | None = None) -> dict[str, Any]:
        """One rollout batch → `ppo_updates` optimizer steps. `version`: the weights' version now,
        for staleness (default: the newest version among the trajectories)."""
        s = self.settings
        batch = collate(trajectories, self.pad_id).to(self.device)
        if version is None:
            version = max(batch.policy_versions)
        advantages = grpo_advantages(batch.rewards, batch.group_index)
        mask = batch.completion_mask
        all_rows = torch.arange(batch.sequences, device=self.device)
        self.model.train()
        with torch.no_grad():
            logp_old = self._logprobs(self.model, batch, all_rows)
            logp_ref = self._logprobs(self.ref_model, batch, all_rows) if self.ref_model is not None else None
        corrections = sparse_rl_corrections(logp_old, batch.logp_sampler, mask, s.loss.corrections)

        updates = min(s.ppo_updates, batch.sequences)
        order = torch.randperm(batch.sequences, generator=self.shuffle).to(self.device)
        loss_sum, clip_sum, grad_norms, kl_ref = 0.0, 0.0, [], []
        for minibatch in order.tensor_split(updates):
            self.optimizer.zero_grad(set_to_none=True)
            normalizer = corrections.rows(minibatch).normalizer(s.loss.aggregation)
            for rows in minibatch.split(s.micro_batch):
                loss, m = self._loss(batch, rows, logp_old, logp_ref, advantages, corrections, normalizer)
                loss.backward()
                loss_sum += float(loss.detach())
                clip_sum += m["clip_fraction"] * float(corrections.keep_token[rows].sum())
                if "kl_ref" in m:
                    kl_ref.append(m["kl_ref"])
            grad_norms.append(float(torch.nn.utils.clip_grad_norm_(self.model.parameters(), s.grad_clip)))
            self.optimizer.step()
        self.step += 1

        kept = corrections.keep_token.sum().clamp(min=1)
        gain: dict[str, float] = {}
        if s.measure_batch_gain:
            with torch.no_grad():
                logp_after = self._logprobs(self.model, batch, all_rows)
            moved = (logp_after - logp_old) * advantages[:, None] * corrections.keep_token
            gain["batch_gain"] = float(moved.sum() / kept)
        if kl_ref:
            gain["kl_ref"] = sum(kl_ref) / len(kl_ref)
        lengths = batch.attention_mask.sum(dim=1).float()
        completion_lengths = mask.sum(dim=1).float()
        return {
            "step": self.step,
            "groups": len(trajectories),
            "sequences": batch.sequences,
            "updates": updates,
            "reward_mean": float(batch.rewards.mean()),
            "reward_std": float(batch.rewards.std()) if batch.sequences > 1 else 0.0,
            "accuracy": float(batch.correct.float().mean()),
            "loss": loss_sum / updates,
            "grad_norm": sum(grad_norms) / len(grad_norms),
            "clip_fraction": clip_sum / float(kept),
            "completion_tokens_mean": float(completion_lengths.mean()),
            # Monte-Carlo estimate of the dense policy's per-token entropy: mean −log π_old of the
            # sampled tokens (exact in expectation for on-policy samples; ξ ≈ 1 keeps it close).
            "entropy": float(-(logp_old * mask).sum() / mask.sum().clamp(min=1)),
            # KV the samplers kept vs what a dense cache holds at the end of each sequence.
            "kv_saved": float(1 - batch.kv_peak_tokens.sum() / lengths.sum()) if batch.kv_peak_tokens.sum() > 0 else 0.0,
            "kv_peak_bytes_mean": float(batch.kv_peak_bytes.mean()),
            "staleness": {str(k): v for k, v in batch.staleness(version).items()},
            "by_staleness": self._by_staleness(batch, version, logp_old),
            **{k: v for k, v in corrections.metrics.items() if k != "kept_tokens"},
            **gain,
        }

    def _loss(self, batch: TrainBatch, rows: torch.Tensor, logp_old: torch.Tensor, logp_ref: torch.Tensor | None,
              advantages: torch.Tensor, corrections: Corrections,
              normalizer: torch.Tensor) -> tuple[torch.Tensor, dict[str, float]]:
        logp_new = self._logprobs(self.model, batch, rows)
        return grpo_loss(logp_new, logp_old[rows], batch.logp_sampler[rows], advantages[rows],
                         batch.completion_mask[rows], self.settings.loss,
                         logp_ref=None if logp_ref is None else logp_ref[rows],
                         corrections=corrections.rows(rows), normalizer=normalizer)

    def _by_staleness(self, batch: TrainBatch, version: int, logp_old: torch.Tensor) -> dict[str, dict[str, float]]:
        versions = torch.tensor(batch.policy_versions, device=self.device)[batch.group_index]
        out = {}
        for lag in sorted(set(batch.staleness(version))):
            rows = (version - versions == lag).nonzero()[:, 0]
            sub = sparse_rl_corrections(logp_old[rows], batch.logp_sampler[rows], batch.completion_mask[rows],
                                        self.settings.loss.corrections)
            out[str(lag)] = {k: sub.metrics[k] for k in _BY_STALENESS} | {"sequences": int(rows.numel())}
        return out

    def _logprobs(self, model: torch.nn.Module, batch: TrainBatch, rows: torch.Tensor) -> torch.Tensor:
        """Token log-probs of `rows`, micro-batched (no_grad callers get the whole set at once)."""
        parts = []
        for chunk in rows.split(self.settings.micro_batch):
            with self._autocast():
                parts.append(token_logprobs(model, batch.input_ids[chunk], batch.attention_mask[chunk],
                                            batch.completion_mask[chunk], self.settings.temperature))
        return torch.cat(parts)

    def _autocast(self) -> contextlib.AbstractContextManager:
        if not self.settings.bf16_autocast:
            return contextlib.nullcontext()
        return torch.autocast(device_type=self.device.type, dtype=torch.bfloat16)

    # -- weights and state --

    def published_state(self) -> dict[str, torch.Tensor]:
        return published_state(self.model)

    def load_published(self, state: dict[str, torch.Tensor]) -> None:
        """Set the master weights to published bf16 values (resume from the registry's head)."""
        params = dict(self.model.named_parameters())
        with torch.no_grad():
            for name, tensor in state.items():
                target = params.get(name)
                if target is None:
                    target = self.model.get_buffer(name)
                target.copy_(tensor.to(target.device, target.dtype))

    def state_dict(self) -> dict[str, Any]:
        return {"model": self.model.state_dict(), "optimizer": self.optimizer.state_dict(), "step": self.step,
                "shuffle": self.shuffle.get_state()}

    def load_state_dict(self, state: dict[str, Any]) -> None:
        self.model.load_state_dict(state["model"])
        self.optimizer.load_state_dict(state["optimizer"])
        self.step = state["step"]
        if "shuffle" in state:
            self.shuffle.set_state(state["shuffle"])
