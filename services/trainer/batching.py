"""Trajectories from Redis → padded tensors for one GRPO step."""

from __future__ import annotations

from collections import Counter
from collections.abc import Sequence
from dataclasses import dataclass

import torch

from shared.schemas import Trajectory


@dataclass
class TrainBatch:
    input_ids: torch.Tensor  # [B, L] prompt + completion, right-padded
    attention_mask: torch.Tensor  # [B, L] 1 on real tokens
    completion_mask: torch.Tensor  # [B, L] 1 on completion tokens
    logp_sampler: torch.Tensor  # [B, L] the rollout engine's log-probs, aligned with input_ids
    rewards: torch.Tensor  # [B]
    correct: torch.Tensor  # [B] bool
    group_index: torch.Tensor  # [B] which trajectory (GRPO group) each sequence belongs to
    policy_versions: list[int]  # per trajectory
    kv_peak_tokens: torch.Tensor  # [B] tokens the sampler's cache held at its peak
    kv_peak_bytes: torch.Tensor  # [B]
    kv_evicted: torch.Tensor  # [B]
    # [B, layers, Hkv, L, L]: the sampler's replayed attention (LossConfig.recompute = "replayed")
    layer_masks: torch.Tensor | None = None

    @property
    def sequences(self) -> int:
        return int(self.input_ids.shape[0])

    def to(self, device: torch.device | str) -> TrainBatch:
        fields = {k: v.to(device) if isinstance(v, torch.Tensor) else v for k, v in self.__dict__.items()}
        return TrainBatch(**fields)  # type: ignore[arg-type]  # the same fields, moved

    def staleness(self, trainer_version: int) -> dict[int, int]:
        """Histogram of (trainer version − version that generated the trajectory)."""
        return dict(sorted(Counter(trainer_version - v for v in self.policy_versions).items()))


def collate(trajectories: Sequence[Trajectory], pad_id: int) -> TrainBatch:
    samples = [(i, s) for i, t in enumerate(trajectories) for s in t.samples]
    if not samples:
        raise ValueError("no samples to train on")
    length = max(len(s.prompt_ids) + len(s.completion_ids) for _, s in samples)
    b = len(samples)
    input_ids = torch.full((b, length), pad_id, dtype=torch.long)
    attention = torch.zeros((b, length), dtype=torch.long)
    completion = torch.zeros((b, length), dtype=torch.long)
    logp = torch.zeros((b, length), dtype=torch.float32)
    for row, (_, s) in enumerate(samples):
        p, c = len(s.prompt_ids), len(s.completion_ids)
        input_ids[row, : p + c] = torch.tensor(s.prompt_ids + s.completion_ids, dtype=torch.long)
        attention[row, : p + c] = 1
        completion[row, p: p + c] = 1
        logp[row, p: p + c] = torch.tensor(s.logprobs, dtype=torch.float32)
    return TrainBatch(
        input_ids=input_ids,
        attention_mask=attention,
        completion_mask=completion,
        logp_sampler=logp,
        rewards=torch.tensor([s.reward for _, s in samples], dtype=torch.float32),
        correct=torch.tensor([s.correct for _, s in samples], dtype=torch.bool),
        group_index=torch.tensor([i for i, _ in samples], dtype=torch.long),
        policy_versions=[t.policy_version for t in trajectories],
        kv_peak_tokens=torch.tensor([s.kv.peak_tokens for _, s in samples], dtype=torch.float32),
        kv_peak_bytes=torch.tensor([s.kv.peak_bytes for _, s in samples], dtype=torch.float32),
        kv_evicted=torch.tensor([s.kv.evicted for _, s in samples], dtype=torch.float32),
    )
