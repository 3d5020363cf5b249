"""Benchmarks: `python -m bench.<name>`, results as JSON under bench/results/."""

from __future__ import annotations

import time
from collections.abc import Callable

import torch


def cuda_ms(fn: Callable[[], object], *, repeats: int, warmup: int = 1) -> float:
    """Mean wall milliseconds of fn on the current CUDA device, after `warmup` calls (compiles)."""
    for _ in range(warmup):
        fn()
    torch.cuda.synchronize()
    start = time.perf_counter()
    for _ in range(repeats):
        fn()
    torch.cuda.synchronize()
    return 1000 * (time.perf_counter() - start) / repeats
