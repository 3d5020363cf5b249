"""What every task with a verifiable reward provides (shared by the trainer and rollout workers)."""

from __future__ import annotations

from abc import ABC, abstractmethod


class Task(ABC):
    """A task: prompts with known answers and a programmatic reward.

    Rewards are computed from text alone (`reward(completion, answer)`), so a rollout worker needs
    only the task name and the prompt's answer string, never the dataset. Completion text is the
    decoded completion without special tokens; a truncated completion simply fails to parse.
    """

    name: str
    format: str  # one line: what a completion must look like to earn reward
    max_new_tokens: int  # generation budget that fits every well-formed completion

    @abstractmethod
    def make_prompts(self, n: int, seed: int) -> list[tuple[str, str]]:
        """`n` (prompt text, answer) pairs, a pure function of `seed`."""

    @abstractmethod
    def reward(self, completion: str, answer: str) -> tuple[float, bool]:
        """(reward in [0, 1], exactly correct)."""

    @abstractmethod
    def check_answer(self, answer: str | None) -> None:
        """Raise ValueError unless reward() can score completions against `answer`. The trainer
        checks every prompt when it is submitted, so a bad answer never reaches a worker."""

    def levels(self) -> list[Task]:
        """The task split by difficulty, each level a task of its own (addition: one per operand
        length). A task without levels is its only one."""
        return [self]

    def demonstration(self, prompt: str, answer: str) -> str:
        """A reference completion (no EOS) for supervised warm-start; synthetic tasks only."""
        raise NotImplementedError(f"task {self.name!r} has no reference completions")


def positional_credit(got: list[str], want: list[str]) -> float:
    """Fraction of `want`'s positions that `got` matches (lengths differing count as misses)."""
    if not want:
        return 0.0
    hits = sum(g == w for g, w in zip(got, want, strict=False))
    return hits / max(len(got), len(want))
