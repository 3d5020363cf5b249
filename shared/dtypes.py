"""Tensor dtypes by name: the one map from names to torch dtypes (patch format, engines, benches)."""

from __future__ import annotations

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
