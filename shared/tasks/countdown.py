"""Countdown: combine all the given numbers with + - * / to reach a target, one step per line.

    prompt      "countdown 3 7 25 to 46\n"
    answer      "3 7 25 -> 46"               (numbers and target: all the reward needs)
    completion  "7*3=21\n25+21=46"

Each line takes two numbers from the pool (the given numbers plus earlier results), writes their
exact result, and puts it back in the pool; the completion is correct when every given number is
used exactly once and the last remaining number is the target. Subtraction must stay non-negative
and division exact, as in the game.
"""

from __future__ import annotations

import random
import re
from collections import Counter
from collections.abc import Iterator

from shared.tasks.base import Task

_PROMPT = re.compile(r"^countdown ([\d ]+) to (\d+)\n$")
_ANSWER = re.compile(r"^([\d ]+) -> (\d+)$")
_STEP = re.compile(r"^(\d+)([-+*/])(\d+)=(\d+)$")


def _apply(x: int, op: str, y: int) -> int | None:
    if op == "+":
        return x + y
    if op == "-":
        return x - y if x >= y else None
    if op == "*":
        return x * y
    return x // y if y and x % y == 0 else None


def _solutions(pool: list[int], target: int) -> Iterator[list[str]]:
    """Depth-first, deterministic: larger operand first, ops in + - * / order."""
    if len(pool) == 1:
        if pool[0] == target:
            yield []
        return
    for i in range(len(pool)):
        for j in range(len(pool)):
            if i == j or pool[i] < pool[j]:
                continue
            rest = [v for k, v in enumerate(pool) if k not in (i, j)]
            for op in "+-*/":
                z = _apply(pool[i], op, pool[j])
                if z is None:
                    continue
                for tail in _solutions([*rest, z], target):
                    yield [f"{pool[i]}{op}{pool[j]}={z}", *tail]


class CountdownTask(Task):
    name = "countdown"
    format = "one step 'x op y=z' per line using every given number once; the last result is the target"

    def __init__(self, min_numbers: int = 3, max_numbers: int = 4, max_value: int = 25) -> None:
        if not 2 <= min_numbers <= max_numbers <= 5:
            raise ValueError(f"need 2 <= min_numbers <= max_numbers <= 5, got {min_numbers}, {max_numbers}")
        self.min_numbers, self.max_numbers, self.max_value = min_numbers, max_numbers, max_value
        self.max_new_tokens = 16 * (max_numbers - 1)

    def make_prompts(self, n: int, seed: int) -> list[tuple[str, str]]:
        rng = random.Random(seed)
        out: list[tuple[str, str]] = []
        while len(out) < n:
            numbers = [rng.randint(1, self.max_value) for _ in range(rng.randint(self.min_numbers, self.max_numbers))]
            # Build the target by a random chain of steps, so every prompt is solvable.
            pool = list(numbers)
            while len(pool) > 1:
                x, y = sorted(rng.sample(pool, 2), reverse=True)
                pool.remove(x)
                pool.remove(y)
                z = _apply(x, rng.choice("+-*/"), y)
                pool.append(x + y if z is None else z)
            if 0 < pool[0] <= 999:
                nums = " ".join(map(str, numbers))
                out.append((f"countdown {nums} to {pool[0]}\n", f"{nums} -> {pool[0]}"))
        return out

    def demonstration(self, prompt: str, answer: str) -> str:
        numbers, target = _parse_answer(answer)
        steps = next(_solutions(numbers, target), None)
        if steps is None:
            raise ValueError(f"no solution for {answer!r}")
        return "\n".join(steps)

    def check_answer(self, answer: str | None) -> None:
        _parse_answer(answer)

    def reward(self, completion: str, answer: str) -> tuple[float, bool]:
        """1 for a valid derivation of the target that uses every number once; else 0."""
        numbers, target = _parse_answer(answer)
        pool = Counter(numbers)
        lines = completion.strip().split("\n")
        for line in lines:
            m = _STEP.match(line.strip())
            if m is None:
                return 0.0, False
            x, op, y, z = int(m.group(1)), m.group(2), int(m.group(3)), int(m.group(4))
            if pool[x] < 1 or pool[y] < (2 if x == y else 1) or _apply(x, op, y) != z:
                return 0.0, False
            pool -= Counter([x, y])
            pool[z] += 1
        ok = +pool == Counter([target])
        return (1.0, True) if ok else (0.0, False)


def _parse_answer(answer: str | None) -> tuple[list[int], int]:
    m = _ANSWER.match(answer.strip()) if isinstance(answer, str) else None
    if m is None or not m.group(1).split():
        raise ValueError(f"a countdown answer looks like '3 7 25 -> 46'; got {answer!r:.40}")
    return [int(v) for v in m.group(1).split()], int(m.group(2))
