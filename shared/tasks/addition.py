"""Multi-digit addition with a digit-by-digit scratchpad.

    prompt      "add 345+678\n"
    completion  "5+8+0=13\n4+7+1=12\n3+6+1=10\n=1023"

One scratchpad line per digit, least significant first: the two digits, the carry in, and the
two-digit column sum whose first digit is the next carry. The scratchpad makes the task learnable
by a tiny model and makes completions long (9 tokens per digit: 32-63 tokens for the default 3-6
digits), so a KV budget of a few dozen tokens bites.
"""

from __future__ import annotations

import random
import re

from shared.tasks.base import Task, positional_credit

_PROMPT = re.compile(r"^add (\d+)\+(\d+)\n$")
_FINAL = re.compile(r"^=(\d+)$")
_SUM = re.compile(r"[0-9]+")


class AdditionTask(Task):
    name = "addition"
    format = "one line 'a+b+carry=ss' per digit (least significant first), then '=SUM'"

    def __init__(self, min_digits: int = 3, max_digits: int = 6) -> None:
        if not 1 <= min_digits <= max_digits:
            raise ValueError(f"need 1 <= min_digits <= max_digits, got {min_digits}, {max_digits}")
        self.min_digits, self.max_digits = min_digits, max_digits
        self.max_new_tokens = 9 * max_digits + max_digits + 3

    def make_prompts(self, n: int, seed: int) -> list[tuple[str, str]]:
        rng = random.Random(seed)
        out = []
        for _ in range(n):
            digits = rng.randint(self.min_digits, self.max_digits)
            a, b = (rng.randrange(10 ** (digits - 1), 10**digits) for _ in range(2))
            out.append((f"add {a}+{b}\n", str(a + b)))
        return out

    def demonstration(self, prompt: str, answer: str) -> str:
        m = _PROMPT.match(prompt)
        if m is None:
            raise ValueError(f"not an addition prompt: {prompt!r}")
        a, b = m.group(1), m.group(2)
        width = max(len(a), len(b))
        a, b = a.zfill(width)[::-1], b.zfill(width)[::-1]
        lines, carry = [], 0
        for x, y in zip(a, b, strict=True):
            s = int(x) + int(y) + carry
            lines.append(f"{x}+{y}+{carry}={s:02d}")
            carry = s // 10
        lines.append(f"={answer}")
        return "\n".join(lines)

    def check_answer(self, answer: str | None) -> None:
        if answer is None or not _SUM.fullmatch(answer):
            raise ValueError(f"an addition answer is the sum's digits, e.g. '579'; got {answer!r:.40}")

    def reward(self, completion: str, answer: str) -> tuple[float, bool]:
        """1 for the exact sum; half credit per matching digit (right-aligned) otherwise; 0 if unparsable."""
        lines = completion.strip().split("\n")
        m = _FINAL.match(lines[-1].strip()) if lines else None
        if m is None:
            return 0.0, False
        got = m.group(1)
        if got == answer:
            return 1.0, True
        return 0.5 * positional_credit(list(got[::-1]), list(answer[::-1])), False
