"""Triton kernels of the CUDA decode path (docs/engine.md, "CUDA graphs").

All of them take the cache's per-row lengths from a device tensor, never from the host, so a decode
step has the same shapes and launches at every length and can be captured in a CUDA graph:

- `qkv_rope_store`: per decode token, q/k norm, RoPE, and the K/V write at slot `lengths[row]`.
- `rms_norm`, `silu_mul`: the rest of a layer's elementwise work, one kernel each.
- `decode_attention`: flash-decoding over the slots `[0, lengths[row] + 1)` of each row (the new
  token included): the G query heads of a KV head are the rows of one tile (no K/V repeat), the
  slots are cut into fixed splits whose partial softmax results one small kernel merges. Splits
  past a row's length exit at once, so the grid can cover the whole capacity.
- `key_redundancy_stats`: R-KV's near-duplicate search without the S×S similarity tensor.

Lengths are clamped to the capacity: rows past the live batch in a padded graph bucket keep
growing without writing out of bounds.
"""

from __future__ import annotations

import torch

try:  # Triton ships with CUDA builds of torch; without it the engine keeps its eager path.
    import triton
    import triton.language as tl
except ImportError:  # pragma: no cover - depends on the install
    triton = None

# Decode-attention tiling, from a sweep on an H100 (split 256-1024 x tile 32-128 x 4/8 warps x 2/3
# stages) at 0.6B batch 32 / 2K, batch 112 / 1.1K and 1.7B batch 16 / 4K: within 1% of the best of
# each, 2.65-2.9 TB/s of K+V, 4-6% faster than 256 x 64 x 4 warps.
SPLIT = 1024  # slots per split
_BLOCK_N = 128  # slots per tile
_WARPS, _STAGES = 8, 2


def _precision(dtype: torch.dtype) -> str:
    # fp32 caches (tests, CPU-sized models) keep fp32 products; TF32 would round them to 10 bits.
    return "ieee" if dtype == torch.float32 else "tf32"


def available() -> bool:
    return triton is not None and torch.cuda.is_available()


if triton is not None:

    @triton.jit
    def _attn_split_kernel(q_ptr, k_ptr, v_ptr, len_ptr, o_ptr, lse_ptr,
                           sq_b, sq_h, sk_b, sk_h, sk_s, cap, scale, n_kv_heads, n_splits,
                           G: tl.constexpr, GP: tl.constexpr, D: tl.constexpr,
                           SPLIT_N: tl.constexpr, BLOCK_N: tl.constexpr, PRECISION: tl.constexpr):
        pid = tl.program_id(0)
        split = tl.program_id(1)
        b = pid // n_kv_heads
        h = pid % n_kv_heads
        length = tl.minimum(tl.load(len_ptr + b) + 1, cap)
        start = split * SPLIT_N
        g = tl.arange(0, GP)
        row_ok = g < G
        rows = b * (n_kv_heads * G) + h * G + g  # flat query-head index of each tile row
        if start >= length:
            tl.store(lse_ptr + rows * n_splits + split, tl.full([GP], float("-inf"), tl.float32), mask=row_ok)
            return
        d = tl.arange(0, D)
        q = tl.load(
            q_ptr + b * sq_b + (h * G + g)[:, None] * sq_h + d[None, :], mask=row_ok[:, None], other=0.0
        )
        m = tl.full([GP], float("-inf"), tl.float32)
        l_sum = tl.zeros([GP], tl.float32)
        acc = tl.zeros([GP, D], tl.float32)
        end = tl.minimum(start + SPLIT_N, length)
        base = b * sk_b + h * sk_h
        for n0 in range(start, end, BLOCK_N):
            n = n0 + tl.arange(0, BLOCK_N)
            ok = n < end
            offs = base + n[:, None] * sk_s + d[None, :]
            k = tl.load(k_ptr + offs, mask=ok[:, None], other=0.0)
            s = tl.dot(q, tl.trans(k), input_precision=PRECISION) * scale
            s = tl.where(ok[None, :], s, float("-inf"))
            m_new = tl.maximum(m, tl.max(s, 1))
            alpha = tl.exp(m - m_new)
            p = tl.exp(s - m_new[:, None])
            l_sum = l_sum * alpha + tl.sum(p, 1)
            v = tl.load(v_ptr + offs, mask=ok[:, None], other=0.0)
            acc = acc * alpha[:, None] + tl.dot(p.to(v.dtype), v, input_precision=PRECISION)
            m = m_new
        out = rows * n_splits + split
        tl.store(o_ptr + out[:, None] * D + d[None, :], acc / l_sum[:, None], mask=row_ok[:, None])
        tl.store(lse_ptr + out, m + tl.log(l_sum), mask=row_ok)

    @triton.jit
    def _attn_combine_kernel(o_ptr, lse_ptr, out_ptr, n_splits, NSP: tl.constexpr, D: tl.constexpr):
        row = tl.program_id(0)
        s = tl.arange(0, NSP)
        d = tl.arange(0, D)
        lse = tl.load(lse_ptr + row * n_splits + s, mask=s < n_splits, other=float("-inf"))
        used = lse > float("-inf")  # splits past the row's length wrote no partial result
        w = tl.where(used, tl.exp(lse - tl.max(lse, 0)), 0.0)
        o = tl.load(o_ptr + (row * n_splits + s)[:, None] * D + d[None, :], mask=used[:, None], other=0.0)
        out = tl.sum(o * w[:, None], 0) / tl.sum(w, 0)
        tl.store(out_ptr + row * D + d, out.to(out_ptr.dtype.element_ty))


    @triton.jit
    def _latest_duplicate_kernel(
        k_ptr,
        len_ptr,
        latest_ptr,
        value_ptr,
        sk_b,
        sk_h,
        sk_s,
        span,
        n_heads,
        threshold,
        D: tl.constexpr,
        BLOCK_M: tl.constexpr,
        BLOCK_N: tl.constexpr,
        PRECISION: tl.constexpr,
    ):
        pid = tl.program_id(0)
        b = pid // n_heads
        h = pid % n_heads
        length = tl.load(len_ptr + b)
        d = tl.arange(0, D)
        i = tl.program_id(1) * BLOCK_M + tl.arange(0, BLOCK_M)
        base = k_ptr + b * sk_b + h * sk_h
        ki = tl.load(base + i[:, None] * sk_s + d[None, :], mask=(i < length)[:, None], other=0.0)
        kf = ki.to(tl.float32)
        inv_i = 1.0 / (tl.sqrt(tl.sum(kf * kf, 1)) + 1e-8)
        latest = tl.full([BLOCK_M], -1, tl.int32)
        value = tl.zeros([BLOCK_M], tl.float32)
        for j0 in range(0, span, BLOCK_N):
            j = j0 + tl.arange(0, BLOCK_N)
            kj = tl.load(base + j[:, None] * sk_s + d[None, :], mask=(j < length)[:, None], other=0.0)
            kjf = kj.to(tl.float32)
            inv_j = 1.0 / (tl.sqrt(tl.sum(kjf * kjf, 1)) + 1e-8)
            sim = tl.dot(ki, tl.trans(kj), input_precision=PRECISION) * inv_i[:, None] * inv_j[None, :]
            # Self-similarity and free slots count as 0 (as in policies.key_redundancy).
            sim = tl.where((i[:, None] != j[None, :]) & (j < length)[None, :], sim, 0.0)
            hit = tl.where((sim > threshold) & (j < span)[None, :], j[None, :], -1)
            best = tl.max(hit, 1)
            found = best >= 0
            best_value = tl.sum(tl.where(j[None, :] == best[:, None], sim, 0.0), 1)
            latest = tl.where(found, best, latest)
            value = tl.where(found, best_value, value)
        out = pid * span + i
        tl.store(latest_ptr + out, latest, mask=i < span)
        tl.store(value_ptr + out, value, mask=i < span)

    @triton.jit
    def _rms_norm_kernel(x_ptr, w_ptr, out_ptr, eps, n, BLOCK: tl.constexpr):
        row = tl.program_id(0)
        c = tl.arange(0, BLOCK)
        ok = c < n
        x = tl.load(x_ptr + row * n + c, mask=ok, other=0.0)
        xf = x.to(tl.float32)
        normed = (xf * tl.rsqrt(tl.sum(xf * xf, 0) / n + eps)).to(x.dtype)
        w = tl.load(w_ptr + c, mask=ok, other=0.0)
        # RMSNorm.forward: weight * rms_norm(x), the norm rounded to x's dtype before the product.
        tl.store(out_ptr + row * n + c, (normed.to(tl.float32) * w.to(tl.float32)).to(x.dtype), mask=ok)

    @triton.jit
    def _silu_mul_kernel(gu_ptr, out_ptr, n, BLOCK: tl.constexpr):
        row = tl.program_id(0)
        c = tl.program_id(1) * BLOCK + tl.arange(0, BLOCK)
        ok = c < n
        g = tl.load(gu_ptr + row * 2 * n + c, mask=ok, other=0.0)
        u = tl.load(gu_ptr + row * 2 * n + n + c, mask=ok, other=0.0)
        gf = g.to(tl.float32)
        act = (gf / (1.0 + tl.exp(-gf))).to(g.dtype)  # F.silu rounds to the input dtype
        tl.store(out_ptr + row * n + c, (act.to(tl.float32) * u.to(tl.float32)).to(g.dtype), mask=ok)

    @triton.jit
    def _qkv_rope_store_kernel(qkv_ptr, qw_ptr, kw_ptr, cos_ptr, sin_ptr, q_ptr, kc_ptr, vc_ptr, len_ptr,
                               win_ptr, next_ptr, s_qkv, sc_b, sc_h, sc_s, sw_b, sw_h, sw_s, cap, eps,
                               HQ: tl.constexpr, HKV: tl.constexpr, D: tl.constexpr, QK_NORM: tl.constexpr,
                               WINDOW: tl.constexpr):
        b = tl.program_id(0)
        h = tl.program_id(1)  # query heads, then key heads, then value heads
        d = tl.arange(0, D)
        x = tl.load(qkv_ptr + b * s_qkv + h * D + d)
        slot = tl.minimum(tl.load(len_ptr + b), cap - 1)
        if h >= HQ + HKV:
            tl.store(vc_ptr + b * sc_b + (h - HQ - HKV) * sc_h + slot * sc_s + d, x)
            return
        swap = tl.where(d < D // 2, d + D // 2, d - D // 2)
        xs = tl.load(qkv_ptr + b * s_qkv + h * D + swap)
        xf = x.to(tl.float32)
        xsf = xs.to(tl.float32)
        if QK_NORM:  # as the model's q_norm / k_norm: weight * rms_norm(x), rounded in between
            r = tl.rsqrt(tl.sum(xf * xf, 0) / D + eps)
            is_q = h < HQ
            w = tl.where(is_q, tl.load(qw_ptr + d), tl.load(kw_ptr + d)).to(tl.float32)
            ws = tl.where(is_q, tl.load(qw_ptr + swap), tl.load(kw_ptr + swap)).to(tl.float32)
            xf = ((xf * r).to(x.dtype).to(tl.float32) * w).to(x.dtype).to(tl.float32)
            xsf = ((xsf * r).to(x.dtype).to(tl.float32) * ws).to(x.dtype).to(tl.float32)
        # apply_rope: x * cos + swap_halves(x) * signed_sin, each product rounded to the dtype.
        c = tl.load(cos_ptr + b * D + d).to(tl.float32)
        sn = tl.load(sin_ptr + b * D + d).to(tl.float32)
        out = ((xf * c).to(x.dtype).to(tl.float32) + (xsf * sn).to(x.dtype).to(tl.float32)).to(x.dtype)
        if h < HQ:
            tl.store(q_ptr + (b * HQ + h) * D + d, out)
            if WINDOW:
                tl.store(win_ptr + b * sw_b + h * sw_h + tl.load(next_ptr) * sw_s + d, out)
        else:
            tl.store(kc_ptr + b * sc_b + (h - HQ) * sc_h + slot * sc_s + d, out)


def key_redundancy_stats(keys: torch.Tensor, lengths: torch.Tensor,
                         threshold: float) -> tuple[torch.Tensor, torch.Tensor]:
    """For keys [B, H, S, D] (row b stores lengths[b] keys): per key i, the latest other key j with
    cosine(k_i, k_j) > threshold (-1 if none) and that cosine -> ([B, H, S] int32, [B, H, S] fp32).
    Cosines from the tensor-core dot of the stored keys (fp32 accumulate) and fp32 norms."""
    b, heads, span, dim = keys.shape
    assert keys.stride(-1) == 1
    latest = torch.empty((b, heads, span), dtype=torch.int32, device=keys.device)
    value = torch.empty((b, heads, span), dtype=torch.float32, device=keys.device)
    # bf16: 128 query keys a program and 8 warps keep the tensor cores busier than 64 (the pass is
    # O(S²) dot products); fp32 operands (tests) keep the smaller tile that fits shared memory.
    block_m, warps, stages = (128, 8, 3) if keys.dtype == torch.bfloat16 else (64, 4, 2)
    _latest_duplicate_kernel[(b * heads, -(-span // block_m))](
        keys, lengths, latest, value, keys.stride(0), keys.stride(1), keys.stride(2), span, heads, threshold,
        D=dim, BLOCK_M=block_m, BLOCK_N=64, PRECISION=_precision(keys.dtype), num_warps=warps,
        num_stages=stages)
    return latest, value


def rms_norm(x: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
    """The model's RMSNorm of contiguous rows x [b, n] in one kernel."""
    b, n = x.shape
    out = torch.empty_like(x)
    _rms_norm_kernel[(b,)](x, weight, out, eps, n, BLOCK=triton.next_power_of_2(n), num_warps=4)
    return out


def silu_mul(gate_up: torch.Tensor) -> torch.Tensor:
    """silu(gate) * up of gate_up [b, 2n] (gate first) -> [b, n], rounded as the MLP rounds."""
    b, n2 = gate_up.shape
    out = torch.empty((b, n2 // 2), dtype=gate_up.dtype, device=gate_up.device)
    _silu_mul_kernel[(b, triton.cdiv(n2 // 2, 1024))](gate_up, out, n2 // 2, BLOCK=1024, num_warps=4)
    return out


def qkv_rope_store(qkv: torch.Tensor, q_norm: torch.Tensor | None, k_norm: torch.Tensor | None, eps: float,
                   cos: torch.Tensor, sin: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor,
                   lengths: torch.Tensor, q_window: torch.Tensor | None, q_next: torch.Tensor,
                   num_heads: int, num_kv_heads: int) -> torch.Tensor:
    """One decode token per row: qkv [b, (Hq + 2 Hkv) D] (the fused projection) -> rotated queries
    [b, Hq, 1, D]. Also normalises q and k per head (Qwen3's q_norm / k_norm, when given), rotates
    k, writes k and v at slot lengths[row] of k_cache/v_cache [>= b, Hkv, cap, D] and the rotated
    queries at slot q_next of q_window [>= b, Hq, W, D] (when given): one kernel for what the
    eager step does in ~13."""
    b = qkv.shape[0]
    dim = cos.shape[-1]
    q = torch.empty((b, num_heads, 1, dim), dtype=qkv.dtype, device=qkv.device)
    window = q_window if q_window is not None else q
    assert qkv.stride(-1) == 1 and k_cache.stride() == v_cache.stride() and window.stride(-1) == 1
    _qkv_rope_store_kernel[(b, num_heads + 2 * num_kv_heads)](
        qkv, q_norm if q_norm is not None else qkv, k_norm if k_norm is not None else qkv, cos, sin, q,
        k_cache, v_cache, lengths, window, q_next, qkv.stride(0), k_cache.stride(0), k_cache.stride(1),
        k_cache.stride(2), window.stride(0), window.stride(1), window.stride(2), k_cache.shape[2], eps,
        HQ=num_heads, HKV=num_kv_heads, D=dim, QK_NORM=q_norm is not None, WINDOW=q_window is not None,
        num_warps=1)
    return q


def attention_buffers(batch: int, num_heads: int, capacity: int, head_dim: int,
                      device: torch.device) -> tuple[torch.Tensor, torch.Tensor]:
    """Partial outputs and log-sum-exps of decode_attention's splits (reused by every layer)."""
    splits = -(-capacity // SPLIT)
    return (torch.empty(batch * num_heads * splits * head_dim, dtype=torch.float32, device=device),
            torch.empty(batch * num_heads * splits, dtype=torch.float32, device=device))


def decode_attention(q: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor, lengths: torch.Tensor,
                     scale: float, buffers: tuple[torch.Tensor, torch.Tensor]) -> torch.Tensor:
    """q [b, Hq, 1, D]; k_cache/v_cache [>= b, Hkv, cap, D] (one layer, new token already stored);
    row r attends to slots [0, lengths[r] + 1). Returns [b, Hq, 1, D] in q's dtype."""
    b, num_heads, _, dim = q.shape
    heads, capacity = k_cache.shape[1], k_cache.shape[2]
    group = num_heads // heads
    splits = -(-capacity // SPLIT)
    partial, lse = buffers
    assert k_cache.stride() == v_cache.stride() and q.stride(-1) == 1 and k_cache.stride(-1) == 1
    _attn_split_kernel[(b * heads, splits)](
        q, k_cache, v_cache, lengths, partial, lse, q.stride(0), q.stride(1), k_cache.stride(0),
        k_cache.stride(1), k_cache.stride(2), capacity, scale, heads, splits,
        G=group, GP=max(16, triton.next_power_of_2(group)), D=dim, SPLIT_N=SPLIT, BLOCK_N=_BLOCK_N,
        PRECISION=_precision(q.dtype), num_warps=_WARPS, num_stages=_STAGES)
    out = torch.empty((b, num_heads, 1, dim), dtype=q.dtype, device=q.device)
    _attn_combine_kernel[(b * num_heads,)](partial, lse, out, splits, NSP=triton.next_power_of_2(splits),
                                          D=dim, num_warps=4)
    return out
