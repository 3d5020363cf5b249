"""Per-sequence bookkeeping of one generate() call (host side; tokens stay on the device until the end)."""

from __future__ import annotations

from dataclasses import dataclass, field

from services.rollout.engine.config import FinishReason, GenerationOutput, KVStats


@dataclass
class Sequence:
    index: int  # position in the request, also the row of the output buffers
    prompt_len: int
    num_generated: int = 0
    finish_reason: FinishReason | None = None
    peak_tokens: int = 0  # most tokens stored at once (per layer and KV head)
    evicted: int = 0  # tokens dropped by compression (per layer and KV head)
    # Decode-step observations (step, stored, evicted) not yet known to precede the finish: the
    # engine reads finishes back every few steps, and a finished row keeps decoding until then.
    pending: list[tuple[int, int, int]] = field(default_factory=list)

    @property
    def finished(self) -> bool:
        return self.finish_reason is not None

    def observe(self, stored: int, evicted: int = 0) -> None:
        self.peak_tokens = max(self.peak_tokens, stored)
        self.evicted += evicted

    def record(self, step: int, stored: int, evicted: int = 0) -> None:
        """An observation made after decoding the token sampled at `step` (counts if the row was live)."""
        self.pending.append((step, stored, evicted))

    def settle(self, live_before: int) -> None:
        """Count the pending observations of steps < live_before (the row was live then), drop the rest."""
        for step, stored, evicted in self.pending:
            if step < live_before:
                self.observe(stored, evicted)
        self.pending.clear()

    def finish(self, step: int, reason: FinishReason) -> None:
        """The token sampled at `step` was the last one."""
        self.num_generated, self.finish_reason = step + 1, reason
        self.settle(step)

    def to_output(
        self, token_ids: list[int], logprobs: list[float], bytes_per_token: int
    ) -> GenerationOutput:
        n = self.num_generated
        return GenerationOutput(
            token_ids=token_ids[:n], logprobs=logprobs[:n], finish_reason=self.finish_reason or "length",
            kv=KVStats(peak_tokens=self.peak_tokens, peak_bytes=self.peak_tokens * bytes_per_token,
                       evicted=self.evicted),
        )
