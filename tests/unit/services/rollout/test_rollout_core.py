"""The rollout core without HTTP: the KV configuration a worker samples with comes from its settings."""

from __future__ import annotations

from pathlib import Path

from services.rollout.core import RolloutCore
from services.rollout.settings import RolloutSettings
from shared.kv import KVSettings


def test_kv_config_follows_the_budget_semantics_setting(tiny_model_dir: str) -> None:
    protected = RolloutCore.from_model_dir(
        RolloutSettings(model=tiny_model_dir, device="cpu", kv=KVSettings(policy="rkv", budget=32, buffer=2)),
        Path(tiny_model_dir),
    )
    kv = protected.kv_config()
    assert (kv.policy, kv.budget, kv.buffer, kv.keep_prompt) == ("rkv", 32, 2, True)
    authors = RolloutCore.from_model_dir(
        RolloutSettings(model=tiny_model_dir, device="cpu", kv=KVSettings(keep_prompt=False)),
        Path(tiny_model_dir),
    )
    assert authors.kv_config().keep_prompt is False
    # A request may still choose its own semantics.
    assert authors.kv_config(keep_prompt=True).keep_prompt is True
