"""Shared pydantic models: validation and JSON round trips (what travels through Redis)."""

from __future__ import annotations

import pytest
from pydantic import ValidationError

from shared.schemas import KVStats, PromptGroup, Sample, Trajectory, WorkerInfo


def test_prompt_group_validation() -> None:
    group = PromptGroup(id="g1", task="addition", prompt="1+1=", answer="2", samples=4, metadata={"level": 3})
    assert PromptGroup.model_validate_json(group.model_dump_json()) == group
    for bad in ({"id": "", "task": "t", "prompt": "p"}, {"id": "g", "task": "t", "prompt": "p", "samples": 0},
                {"id": "g", "task": "t", "prompt": "p", "extra": 1}):
        with pytest.raises(ValidationError):
            PromptGroup.model_validate(bad)


def test_sample_needs_one_logprob_per_completion_token() -> None:
    fields = dict(completion="ab", prompt_ids=[1], completion_ids=[2, 3], reward=0.0, correct=False,
                  finish_reason="length")
    with pytest.raises(ValidationError, match="logprobs has 1 entries for 2"):
        Sample(logprobs=[-1.0], **fields)
    assert Sample(logprobs=[-1.0, -2.0], **fields).kv == KVStats()


def test_trajectory_and_worker_round_trip() -> None:
    sample = Sample(completion="2", prompt_ids=[5], completion_ids=[6], logprobs=[-0.1], reward=1.0,
                    correct=True, finish_reason="stop", kv=KVStats(peak_tokens=2, peak_bytes=64, evicted=1))
    trajectory = Trajectory(group_id="g", attempt=2, policy_version=3, worker_id="w", task="t", prompt="p",
                            samples=[sample])
    assert Trajectory.model_validate_json(trajectory.model_dump_json()) == trajectory
    info = WorkerInfo(worker_id="w", engine="vllm", kv_policy="rkv", kv_budget=512, weight_version=3,
                      tokens_per_s=1e3, download_mbps=100.0, leases=2, url="http://w:8200")
    assert WorkerInfo.model_validate_json(info.model_dump_json()) == info
    with pytest.raises(ValidationError):
        Trajectory(group_id="g", attempt=0, policy_version=0, worker_id="w", task="t", prompt="p", samples=[])
