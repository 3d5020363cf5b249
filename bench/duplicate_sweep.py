"""R-KV's near-duplicate pass, tiling and variants: `python -m bench.duplicate_sweep` (CUDA).

What `kernels._latest_duplicate_kernel` was chosen from. Per shape (0.6B at batch 112 with 1,168
stored keys, 1.7B at batch 59 with 2,192: the equal-memory benches' caches), random bf16 keys with
two planted duplicates, every variant is checked against the production scoring (kernels.key_scores)
and timed over the 28 layers of one compression:
- `triangle, skip`: the production kernel at several tilings: each pair once (programs over blocks
  of keys i, tiles j >= i, an atomic max for the columns), and a tile whose largest cosine is under
  the threshold skips the index reductions;
- `triangle`: the same without that test;
- `square`: every (i, j) in the program of i, no atomics (twice the dot products).
JSON: bench/results/duplicate-sweep-<device>.json.
"""

from __future__ import annotations

import argparse
import json
from collections.abc import Callable
from pathlib import Path
from typing import Any

import torch
import triton
import triton.language as tl

from bench import cuda_ms
from services.rollout.engine import kernels

RESULTS = Path(__file__).resolve().parent / "results"
LAYERS, HEADS, DIM, THRESHOLD = 28, 8, 128, 0.5


@triton.jit
def _tile(ki, inv_i, i, kj, inv_j, j, threshold, best_row, latest_row, DIAGONAL: tl.constexpr,
          PRECISION: tl.constexpr):
    """kernels._duplicate_tile without the skip test."""
    sim = tl.dot(ki, tl.trans(kj), input_precision=PRECISION) * inv_i[:, None] * inv_j[None, :]
    if DIAGONAL:
        sim = tl.where(j[None, :] > i[:, None], sim, 0.0)
    hit = sim > threshold
    best_row = tl.maximum(best_row, tl.max(tl.where(hit, j[None, :], -1), 1))
    best_col = tl.max(tl.where(hit, i[:, None], -1), 0)
    tl.atomic_max(latest_row + j, best_col, mask=best_col >= 0, sem="relaxed")
    return best_row


@triton.jit
def _triangle(k_ptr, inv_ptr, len_ptr, latest_ptr, sk_b, sk_h, sk_s, span, n_heads, threshold,
              D: tl.constexpr, BLOCK: tl.constexpr, PRECISION: tl.constexpr):
    """kernels._latest_duplicate_kernel over `_tile`."""
    pid = tl.program_id(0)
    b = pid // n_heads
    h = pid % n_heads
    length = tl.load(len_ptr + b).to(tl.int32)
    i0 = (tl.num_programs(1) - 1 - tl.program_id(1)) * BLOCK
    if i0 >= length:
        return
    d = tl.arange(0, D)
    base = k_ptr + b * sk_b + h * sk_h
    latest_row = latest_ptr + pid * span
    i = i0 + tl.arange(0, BLOCK)
    ki = tl.load(base + i[:, None] * sk_s + d[None, :], mask=(i < length)[:, None], other=0.0)
    inv_i = tl.load(inv_ptr + pid * span + i, mask=i < length, other=0.0)
    best_row = tl.full([BLOCK], -1, tl.int32)
    best_row = _tile(ki, inv_i, i, ki, inv_i, i, threshold, best_row, latest_row, DIAGONAL=True,
                     PRECISION=PRECISION)
    for j0 in range(i0 + BLOCK, length, BLOCK):
        j = j0 + tl.arange(0, BLOCK)
        kj = tl.load(base + j[:, None] * sk_s + d[None, :], mask=(j < length)[:, None], other=0.0)
        inv_j = tl.load(inv_ptr + pid * span + j, mask=j < length, other=0.0)
        best_row = _tile(ki, inv_i, i, kj, inv_j, j, threshold, best_row, latest_row, DIAGONAL=False,
                         PRECISION=PRECISION)
    tl.atomic_max(latest_row + i, best_row, mask=best_row >= 0, sem="relaxed")


@triton.jit
def _square(k_ptr, inv_ptr, len_ptr, latest_ptr, sk_b, sk_h, sk_s, span, n_heads, threshold,
            D: tl.constexpr, BLOCK: tl.constexpr, BLOCK_N: tl.constexpr):
    pid = tl.program_id(0)
    b = pid // n_heads
    h = pid % n_heads
    length = tl.load(len_ptr + b).to(tl.int32)
    i0 = tl.program_id(1) * BLOCK
    if i0 >= length:
        return
    d = tl.arange(0, D)
    base = k_ptr + b * sk_b + h * sk_h
    i = i0 + tl.arange(0, BLOCK)
    ki = tl.load(base + i[:, None] * sk_s + d[None, :], mask=(i < length)[:, None], other=0.0)
    inv_i = tl.load(inv_ptr + pid * span + i, mask=i < length, other=0.0)
    best_row = tl.full([BLOCK], -1, tl.int32)
    for j0 in range(0, length, BLOCK_N):
        j = j0 + tl.arange(0, BLOCK_N)
        kj = tl.load(base + j[:, None] * sk_s + d[None, :], mask=(j < length)[:, None], other=0.0)
        inv_j = tl.load(inv_ptr + pid * span + j, mask=j < length, other=0.0)
        sim = tl.dot(ki, tl.trans(kj)) * inv_i[:, None] * inv_j[None, :]
        sim = tl.where(j[None, :] != i[:, None], sim, 0.0)
        best_row = tl.maximum(best_row, tl.max(tl.where(sim > threshold, j[None, :], -1), 1))
    tl.store(latest_ptr + pid * span + i, best_row, mask=i < length)


def sweep(batch: int, span: int) -> dict[str, object]:
    torch.manual_seed(0)
    keys = torch.randn(batch, HEADS, span, DIM, device="cuda", dtype=torch.bfloat16)
    keys[:, :, 900] = keys[:, :, 33]
    keys[:, :, 500] = keys[:, :, 1000]
    queries = torch.randn(batch, 2 * HEADS, 8, DIM, device="cuda", dtype=torch.bfloat16)
    lengths = torch.full((batch,), span, device="cuda")
    want = kernels.key_scores(keys, lengths, queries, 0, THRESHOLD).latest
    inv = 1.0 / (keys.float().norm(dim=-1) + 1e-8)  # as kernels._key_pass_kernel (every slot stored)
    latest = torch.empty((batch, HEADS, span), dtype=torch.int32, device="cuda")
    grid = (batch * HEADS,)
    rows: list[dict[str, object]] = []

    def record(variant: str, config: str, launch: Callable[[], None]) -> None:
        ms = cuda_ms(launch, repeats=5) * LAYERS
        rows.append({"variant": variant, "config": config, "ms_per_compression": round(ms, 2),
                     "equal": torch.equal(latest, want)})

    triangles = (("triangle, skip", kernels._latest_duplicate_kernel), ("triangle", _triangle))
    for block, warps, stages in ((128, 4, 2), (128, 4, 3), (128, 8, 2), (128, 8, 3), (64, 4, 2), (64, 4, 3)):
        for variant, kernel in triangles:
            def triangle(kernel: Any = kernel, block: int = block, warps: int = warps,
                         stages: int = stages) -> None:
                latest.fill_(-1)
                kernel[(*grid, -(-span // block))](
                    keys, inv, lengths, latest, *keys.stride()[:3], span, HEADS, THRESHOLD, D=DIM,
                    BLOCK=block, PRECISION="tf32", num_warps=warps, num_stages=stages)
            record(variant, f"{block} keys, {warps} warps, {stages} stages", triangle)
    for block, block_n, warps, stages in ((128, 64, 8, 3), (128, 64, 4, 3), (128, 128, 8, 2), (64, 64, 4, 3)):
        def square(block: int = block, block_n: int = block_n, warps: int = warps,
                   stages: int = stages) -> None:
            _square[(*grid, -(-span // block))](
                keys, inv, lengths, latest, *keys.stride()[:3], span, HEADS, THRESHOLD, D=DIM, BLOCK=block,
                BLOCK_N=block_n, num_warps=warps, num_stages=stages)
        record("square", f"{block}x{block_n} keys, {warps} warps, {stages} stages", square)
    production = cuda_ms(lambda: kernels.key_scores(keys, lengths, queries, 0, THRESHOLD), repeats=5) * LAYERS
    pair_flops = batch * HEADS * span * span * DIM * LAYERS  # 2 flops a multiply-add, each pair once
    return {"batch": batch, "stored_keys": span, "pair_tflop_per_compression": round(pair_flops / 1e12, 2),
            "key_scores_ms": round(production, 2), "variants": rows}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--out")
    args = parser.parse_args()
    device = torch.cuda.get_device_name()
    result = {"bench": "duplicate-sweep", "device": device, "threshold": THRESHOLD, "layers": LAYERS,
              "shapes": {"0.6b": sweep(112, 1168), "1.7b": sweep(59, 2192)}}
    print(json.dumps(result, indent=1))
    card = "h100" if "H100" in device else "cuda"
    out = Path(args.out) if args.out else RESULTS / f"duplicate-sweep-{card}.json"
    out.write_text(json.dumps(result, indent=1) + "\n")


if __name__ == "__main__":
    main()
