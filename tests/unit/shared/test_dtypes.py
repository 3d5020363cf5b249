"""shared.dtypes.compute_dtype: fp32 where a CPU only emulates bf16 / fp16 products."""

from __future__ import annotations

import os
import platform
import subprocess
import sys

import pytest
import torch

from shared.dtypes import compute_dtype


def test_wide_dtypes_and_gpus_compute_as_stored() -> None:
    cpu = torch.device("cpu")
    assert compute_dtype(cpu, torch.float32) == torch.float32
    assert compute_dtype(cpu, torch.float64) == torch.float64
    assert compute_dtype(torch.device("cuda"), torch.bfloat16) == torch.bfloat16
    assert compute_dtype(cpu, torch.bfloat16) in (torch.bfloat16, torch.float32)


@pytest.mark.skipif(platform.machine() not in ("x86_64", "AMD64"), reason="oneDNN's x86 ISA cap")
def test_bf16_computes_in_fp32_on_a_cpu_capped_at_avx2() -> None:
    """oneDNN capped at AVX2 emulates bf16 as a CPU without AVX512-BF16 / AMX does (~30x slower
    than fp32): the check must see it, in a fresh process (the cap is read at start)."""
    code = ("import torch; from shared.dtypes import compute_dtype; "
            "print(compute_dtype(torch.device('cpu'), torch.bfloat16))")
    env = os.environ | {"ONEDNN_MAX_CPU_ISA": "AVX2", "ATEN_CPU_CAPABILITY": "avx2"}
    out = subprocess.run([sys.executable, "-c", code], env=env, capture_output=True, text=True, check=True,
                         timeout=120)
    assert out.stdout.strip() == "torch.float32"
