"""bench.engine's bytes per decode step follow the engine's own compressions."""

from __future__ import annotations

import pytest
import torch

from bench.engine import stored_tokens_read, with_bandwidth_limit
from services.rollout.engine import KVConfig, LLMEngine, SamplingParams
from services.rollout.engine.sequence import Sequence
from services.rollout.models.decoder import DecoderLM
from tests.unit.services.rollout.engine.engine_helpers import one_thread, tiny_config

single_thread = pytest.fixture(autouse=True)(one_thread)


@pytest.mark.parametrize(
    ("prompt", "kv"),
    [
        (5, KVConfig()),
        (5, KVConfig(policy="rkv", budget=16, buffer=4)),
        (5, KVConfig(policy="snapkv", budget=12, buffer=1, keep_prompt=False)),
        (30, KVConfig(policy="streaming", budget=16, buffer=4, keep_prompt=False)),  # prompt cut at once
        (5, KVConfig(policy="rkv", budget=16, buffer=4, layer_budgets="pyramid")),
    ],
)
def test_stored_tokens_read_equal_what_the_engine_stores(
    prompt: int, kv: KVConfig, monkeypatch: pytest.MonkeyPatch
) -> None:
    torch.manual_seed(0)
    config = tiny_config(layers=4)
    engine = LLMEngine(DecoderLM(config), device=torch.device("cpu"))
    seen: list[int] = []  # tokens stored after each decode step's write (what that step read)
    record = Sequence.record

    def spy(self: Sequence, step: int, stored: int, evicted: int = 0) -> None:
        if self.index == 0 and evicted == 0:
            seen.append(stored)
        record(self, step, stored, evicted)

    monkeypatch.setattr(Sequence, "record", spy)
    gen = 40
    prompts = [[(7 * i + 3) % config.vocab_size for i in range(prompt)]] * 2
    engine.generate(prompts, SamplingParams(temperature=0.0, max_new_tokens=gen), kv)
    assert len(seen) == gen - 1  # the first token comes from the prefill
    # The engine reports the mean over layers rounded, exact when every layer has the same budget.
    tolerance = 0.5 if kv.layer_budgets == "pyramid" else 1e-9
    assert stored_tokens_read(prompt, gen, kv, config.num_hidden_layers) == pytest.approx(
        sum(seen) / len(seen), abs=tolerance)


def test_bandwidth_limit_of_a_row() -> None:
    row = with_bandwidth_limit({"batch": 4, "ms_per_step": 2.0}, weight_bytes=1000, kv_bytes_per_token=10,
                               prompt=2, gen=4, kv=KVConfig(), layers=3, bandwidth=1e6)
    # Dense decode steps read prompt + 1 ... prompt + gen - 1 tokens: 4 on average.
    assert row["stored_tokens_read_mean"] == 4
    assert row["bytes_per_step"] == 1000 + 4 * 4 * 10
    assert row["limit_ms_per_step"] == pytest.approx(1.16)
    assert row["x_limit"] == pytest.approx(2.0 / 1.16, abs=1e-3)
