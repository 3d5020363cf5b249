"""Tasks with verifiable rewards, shared by the trainer (prompts) and rollout workers (rewards).

    task = get_task("addition")
    prompts = task.make_prompts(8, seed=0)          # [(prompt text, answer), ...]
    reward, correct = task.reward(completion, answer)

Built-ins: addition (scratchpad), sorting, countdown (synthetic, with reference completions for
the warm-start), and gsm8k (numeric answers from a user's JSONL: get_task("gsm8k", source=PATH)).
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

from shared.tasks.addition import AdditionTask
from shared.tasks.base import Task
from shared.tasks.countdown import CountdownTask
from shared.tasks.numeric import NumericAnswerTask, load_numeric_jsonl, parse_number
from shared.tasks.sorting import SortingTask

_REGISTRY: dict[str, Callable[..., Task]] = {
    "addition": AdditionTask,
    "sorting": SortingTask,
    "countdown": CountdownTask,
    "gsm8k": NumericAnswerTask,
}


def list_tasks() -> list[str]:
    return sorted(_REGISTRY)


def get_task(name: str, **options: Any) -> Task:
    """A task by name; `options` go to its constructor (e.g. max_digits=6, source=PATH)."""
    try:
        factory = _REGISTRY[name]
    except KeyError:
        raise KeyError(f"unknown task {name!r}; known: {', '.join(list_tasks())}") from None
    return factory(**options)


__all__ = [
    "AdditionTask",
    "CountdownTask",
    "NumericAnswerTask",
    "SortingTask",
    "Task",
    "get_task",
    "list_tasks",
    "load_numeric_jsonl",
    "parse_number",
]
