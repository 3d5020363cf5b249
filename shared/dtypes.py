"""Tensor dtypes by name: the one map from names to torch dtypes (patch format, engines, benches)."""

from __future__ import annotations

import functools
import time
from typing import Literal, get_args

import torch

# Every dtype a patch or snapshot may carry, by the name the patch format writes.
DTYPES: dict[str, torch.dtype] = {
    "bfloat16": torch.bfloat16,
    "float16": torch.float16,
    "float32": torch.float32,
    "float64": torch.float64,
    "int8": torch.int8,
    "uint8": torch.uint8,
    "int16": torch.int16,
    "int32": torch.int32,
    "int64": torch.int64,
}
# What a model may be served in (the rollout's SPARSECAST_DTYPE), and the benches' short names.
ModelDtype = Literal["bfloat16", "float16", "float32"]
MODEL_DTYPES: tuple[ModelDtype, ...] = get_args(ModelDtype)
SHORT_NAMES: dict[str, ModelDtype] = {"bf16": "bfloat16", "fp16": "float16", "fp32": "float32"}


def dtype_name(dtype: torch.dtype) -> str:
    """The name DTYPES knows `dtype` by ("bfloat16" for torch.bfloat16)."""
    return str(dtype).removeprefix("torch.")


def by_short_name() -> dict[str, torch.dtype]:
    """bf16/fp16/fp32 to torch dtypes (the benches' --dtype choices)."""
    return {short: DTYPES[name] for short, name in SHORT_NAMES.items()}


def compute_dtype(device: torch.device, dtype: torch.dtype) -> torch.dtype:
    """The dtype to compute in with weights stored in `dtype` on `device`: the same, except fp32 on
    a CPU that only emulates bf16/fp16 matrix products (x86 without AVX512-BF16 or AMX, e.g. AVX2:
    a 256x256 bf16 matmul 13 ms against 0.4 ms in fp32). GPUs are taken to compute them natively."""
    if device.type != "cpu" or dtype not in (torch.bfloat16, torch.float16):
        return dtype
    return dtype if _cpu_matmul_is_native(dtype) else torch.float32


@functools.cache
def _cpu_matmul_is_native(dtype: torch.dtype) -> bool:
    """Measured once per process, on one thread (a few ms natively, ~0.1 s emulated): native units
    are at least as fast as fp32 (0.09 against 0.5 ms on AVX512-BF16), emulation ~30x slower, so
    3x between the best of five tells them apart on a busy machine too."""
    wide = torch.randn(256, 256)
    narrow = wide.to(dtype)

    def best_of_five(x: torch.Tensor) -> float:
        x @ x  # warm-up: the library picks and prepares its kernel
        times = []
        for _ in range(5):
            start = time.perf_counter()
            x @ x
            times.append(time.perf_counter() - start)
        return min(times)

    threads = torch.get_num_threads()
    torch.set_num_threads(1)  # one thread: no wait for a sibling the scheduler put aside
    try:
        return best_of_five(narrow) <= 3 * best_of_five(wide)
    finally:
        torch.set_num_threads(threads)
