"""Multi-digit addition with a digit-by-digit scratchpad.

    prompt      "add 345+678\n"
    completion  "5+8+0=13:3\n4+7+1=12:23\n3+6+1=10:023\n=1023"               (scratchpad="sum", the default)
    completion  "5+8+0=13\n4+7+1=12\n3+6+1=10\n=1023"                      (scratchpad="column")
    completion  "345+678:5+8+0=13\n34+67:4+7+1=12\n3+6:3+6+1=10\n=1023"     (scratchpad="running")

One scratchpad line per digit, least significant first: the two digits, the carry in, and the
two-digit column sum whose first digit is the next carry. The scratchpad makes the task learnable
by a tiny model and makes completions long (9 tokens per digit: 32-63 tokens for the default 3-6
digits), so a KV budget of a few dozen tokens bites.

"column" lines say nothing of which digit they are: the model finds the next digit pair in the
prompt by counting its earlier lines, so evicting those lines derails it (docs/training.md). The
"running" scratchpad starts each line with what is left of both operands, whose last digits are
that line's column: every line follows from the line before it alone, so a KV cache that keeps
the last line or two (R-KV keeps the newest copy of repeated digits) loses nothing the next line
needs. Completions are longer: at most n² + 13n + 2 tokens for n digits (column: 10n + 2).
"sum" lines end with the sum's digits so far (each line puts its column's digit in front, so line
k carries k of them): the last line holds every digit the answer needs but the final carry, and a
line's count of sum digits says which column comes next. A cache that keeps the last line keeps
what the answer needs, where "column" and "running" ask for the second digit of every earlier line
(docs/training.md, "On the issue's kind again"). At most (n² + 23n + 4) / 2 tokens. The default since
issue 26's twenty-second stop: with the prompt kept in the cache, every line needs only the prompt
and the line before it, and the demo met its criteria on both CPU kinds where "column" had not
(docs/training.md, "The sum scratchpad in the demo").
"""

from __future__ import annotations

import random
import re
from typing import Literal, get_args

from shared.tasks.base import Task, positional_credit

Scratchpad = Literal["column", "running", "sum"]

# What a completion must look like, per scratchpad (Task.format).
_FORMATS: dict[str, str] = {
    "column": "one line 'a+b+carry=ss' per digit (least significant first), then '=SUM'",
    "running": "one line 'a_rest+b_rest:a+b+carry=ss' per digit (least significant first), then '=SUM'",
    "sum": "one line 'a+b+carry=ss:sum digits so far' per digit (least significant first), then '=SUM'",
}
_PROMPT = re.compile(r"^add (\d+)\+(\d+)\n$")
_FINAL = re.compile(r"^=(\d+)$")
_SUM = re.compile(r"[0-9]+")


class AdditionTask(Task):
    name = "addition"
    format = _FORMATS["sum"]  # the default scratchpad's; an instance has its own

    def __init__(self, min_digits: int = 3, max_digits: int = 6,
                 scratchpad: Scratchpad = "sum") -> None:
        if not 1 <= min_digits <= max_digits:
            raise ValueError(f"need 1 <= min_digits <= max_digits, got {min_digits}, {max_digits}")
        if scratchpad not in get_args(Scratchpad):
            known = ", ".join(get_args(Scratchpad))
            raise ValueError(f"scratchpad must be one of {known}, got {scratchpad!r}")
        self.min_digits, self.max_digits, self.scratchpad = min_digits, max_digits, scratchpad
        self.format = _FORMATS[scratchpad]
        n = max_digits
        # Lines of 9 characters (+ the running operands and their separators: 2(n − k + 1) + 2; + ":" and
        # the k sum digits so far for "sum"), the final "=SUM" (≤ n + 2 characters), EOS.
        extra = {"column": 0, "running": n * (n + 1) + 2 * n, "sum": n * (n + 1) // 2 + n}[scratchpad]
        self.max_new_tokens = 9 * n + n + 3 + extra

    def make_prompts(self, n: int, seed: int) -> list[tuple[str, str]]:
        rng = random.Random(seed)
        # Digit counts cycle through the range from a random start: any `span` consecutive prompts
        # hold each length once, so a batch's difficulty (and its reward) does not swing with the
        # draw, and one prompt alone still gets a random length.
        span = self.max_digits - self.min_digits + 1
        start = rng.randrange(span)
        out = []
        for i in range(n):
            digits = self.min_digits + (start + i) % span
            a, b = (rng.randrange(10 ** (digits - 1), 10**digits) for _ in range(2))
            out.append((f"add {a}+{b}\n", str(a + b)))
        return out

    def levels(self) -> list[Task]:
        return [AdditionTask(d, d, self.scratchpad) for d in range(self.min_digits, self.max_digits + 1)]

    def demonstration(self, prompt: str, answer: str) -> str:
        m = _PROMPT.match(prompt)
        if m is None:
            raise ValueError(f"not an addition prompt: {prompt!r}")
        a, b = m.group(1), m.group(2)
        width = max(len(a), len(b))
        a, b = a.zfill(width)[::-1], b.zfill(width)[::-1]
        lines, carry, digits = [], 0, ""
        for k, (x, y) in enumerate(zip(a, b, strict=True)):
            s = int(x) + int(y) + carry
            digits = f"{s % 10}{digits}"
            rest = f"{a[k:][::-1]}+{b[k:][::-1]}:" if self.scratchpad == "running" else ""
            so_far = f":{digits}" if self.scratchpad == "sum" else ""
            lines.append(f"{rest}{x}+{y}+{carry}={s:02d}{so_far}")
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
