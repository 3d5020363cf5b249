"""Sort a list of small integers ascending.

    prompt      "sort 42 7 19 88 3\n"
    completion  "3 7 19 42 88"
"""

from __future__ import annotations

import random
import re

from shared.tasks.base import Task, positional_credit

_SORTED = re.compile(r"[0-9]+( [0-9]+)*")


class SortingTask(Task):
    name = "sorting"
    format = "the numbers ascending, separated by single spaces"

    def __init__(self, min_len: int = 5, max_len: int = 12, max_value: int = 99) -> None:
        if not 1 <= min_len <= max_len:
            raise ValueError(f"need 1 <= min_len <= max_len, got {min_len}, {max_len}")
        self.min_len, self.max_len, self.max_value = min_len, max_len, max_value
        self.max_new_tokens = max_len * (len(str(max_value)) + 1) + 2

    def make_prompts(self, n: int, seed: int) -> list[tuple[str, str]]:
        rng = random.Random(seed)
        out = []
        for _ in range(n):
            values = [rng.randint(0, self.max_value) for _ in range(rng.randint(self.min_len, self.max_len))]
            out.append((f"sort {' '.join(map(str, values))}\n", " ".join(map(str, sorted(values)))))
        return out

    def demonstration(self, prompt: str, answer: str) -> str:
        return answer

    def check_answer(self, answer: str | None) -> None:
        if answer is None or not _SORTED.fullmatch(answer):
            raise ValueError(
                "a sorting answer is the numbers separated by single spaces, e.g. '3 7 19'; got "
                f"{answer!r:.40}"
            )

    def reward(self, completion: str, answer: str) -> tuple[float, bool]:
        """1 for the exact sorted list; half credit per matching position otherwise; 0 if unparsable."""
        got = completion.strip().split(" ")
        if not all(tok.isdigit() for tok in got):
            return 0.0, False
        want = answer.split(" ")
        if got == want:
            return 1.0, True
        return 0.5 * positional_credit(got, want), False
