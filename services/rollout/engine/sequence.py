"""Per-sequence bookkeeping of one generate() call (host side; tokens stay on the device until the end)."""

from __future__ import annotations

from dataclasses import dataclass

from services.rollout.engine.config import FinishReason, GenerationOutput, KVStats


@dataclass
class Sequence:
    index: int  # position in the request, also the row of the output buffers
    prompt_len: int
    num_generated: int = 0
    finish_reason: FinishReason | None = None
    peak_tokens: int = 0  # most tokens stored at once (per layer and KV head)
    evicted: int = 0  # tokens dropped by compression (per layer and KV head)

    @property
    def finished(self) -> bool:
        return self.finish_reason is not None

    def observe(self, stored: int, evicted: int = 0) -> None:
        self.peak_tokens = max(self.peak_tokens, stored)
        self.evicted += evicted

    def to_output(self, token_ids: list[int], logprobs: list[float], bytes_per_token: int) -> GenerationOutput:
        n = self.num_generated
        return GenerationOutput(
            token_ids=token_ids[:n], logprobs=logprobs[:n], finish_reason=self.finish_reason or "length",
            kv=KVStats(peak_tokens=self.peak_tokens, peak_bytes=self.peak_tokens * bytes_per_token,
                       evicted=self.evicted),
        )
