"""Numeric-answer questions from a user's JSONL file (GSM8K style), for real models.

Each line is {"question": str, "answer": str}; the answer's final number follows '####' as in
GSM8K ("... so she has 72 left.\n#### 72"), or the whole answer is a number. The reward compares
numbers, not strings: "1,000", "$1000", "1000.0" all equal 1000.
"""

from __future__ import annotations

import json
import random
import re
from decimal import Decimal, InvalidOperation
from pathlib import Path

from shared.tasks.base import Task

_NUMBER = re.compile(r"-?\$?\d[\d,]*(?:\.\d+)?")
PROMPT_TEMPLATE = "Question: {question}\nAnswer:"


def parse_number(text: str) -> Decimal | None:
    """The number a model or dataset meant: after the last '####' if present, else the last number."""
    if "####" in text:
        found = _NUMBER.search(text.rsplit("####", 1)[1])
    else:
        matches = list(_NUMBER.finditer(text))
        found = matches[-1] if matches else None
    if found is None:
        return None
    try:
        return Decimal(found.group(0).replace(",", "").replace("$", ""))
    except InvalidOperation:
        return None


def load_numeric_jsonl(path: str | Path) -> list[tuple[str, str]]:
    """(prompt, answer) pairs; the answer is the final number as a plain string."""
    out = []
    for lineno, line in enumerate(Path(path).read_text().splitlines(), 1):
        if not line.strip():
            continue
        try:
            row = json.loads(line)
            question, answer = row["question"], str(row["answer"])
        except (json.JSONDecodeError, KeyError, TypeError) as e:
            raise ValueError(f"{path}:{lineno}: need a JSON object with 'question' and 'answer' ({e})") from e
        try:
            out.append(numeric_row(question, answer))
        except ValueError as e:
            raise ValueError(f"{path}:{lineno}: {e}") from e
    return out


def numeric_row(question: str, answer: str) -> tuple[str, str]:
    """(prompt, final number as a plain string) of one GSM8K-style row."""
    number = parse_number(answer)
    if number is None:
        raise ValueError(f"no final number in answer {answer!r}")
    return PROMPT_TEMPLATE.format(question=question), _plain(number)


def _plain(number: Decimal) -> str:
    # Normalise "72.00" → "72" and never use exponent notation.
    return format(number.normalize(), "f") if number != number.to_integral() else str(int(number))


class NumericAnswerTask(Task):
    name = "gsm8k"
    format = "free-form reasoning ending in '#### N' (or the last number in the text counts)"
    max_new_tokens = 512

    def __init__(self, source: str | Path | None = None) -> None:
        # Rewarding needs no data file (workers get the answer with each prompt); making prompts does.
        self.source = Path(source) if source is not None else None

    def make_prompts(self, n: int, seed: int) -> list[tuple[str, str]]:
        if self.source is None:
            raise ValueError("task 'gsm8k' makes prompts from a JSONL file: get_task('gsm8k', source=PATH)")
        rows = load_numeric_jsonl(self.source)
        if not rows:
            raise ValueError(f"{self.source}: no rows")
        rng = random.Random(seed)
        order = list(range(len(rows)))
        rng.shuffle(order)
        # Cycle through a fixed shuffle so n may exceed the file size without clustering repeats.
        return [rows[order[i % len(rows)]] for i in range(n)]

    def check_answer(self, answer: str | None) -> None:
        if answer is None or parse_number(answer) is None:
            raise ValueError(f"a gsm8k answer holds a number (after '####' if present); got {answer!r:.40}")

    def reward(self, completion: str, answer: str) -> tuple[float, bool]:
        """1 when the completion's final number equals the answer numerically; else 0."""
        got, want = parse_number(completion), parse_number(answer)
        ok = got is not None and want is not None and got == want
        return (1.0, True) if ok else (0.0, False)
