"""Triton kernels of the CUDA decode path (docs/engine.md, "CUDA graphs").

All of them take the cache's per-row lengths from a device tensor, never from the host, so a decode
step has the same shapes and launches at every length and can be captured in a CUDA graph:

- `qkv_rope_store`: per decode token, q/k norm, RoPE, and the K/V write at slot `lengths[row]`.
- `rms_norm`, `silu_mul`: the rest of a layer's elementwise work, one kernel each.
- `greedy`, `sample`: a step's token and recorded log-prob in one pass (greedy) or three (inverse-CDF
  sampling) over the logits.
- `decode_attention`: flash-decoding over the slots `[0, lengths[row] + 1)` of each row (the new
  token included): the G query heads of a KV head are the rows of one tile (no K/V repeat), the
  slots are cut into fixed splits whose partial softmax results one small kernel merges. Splits
  past a row's length exit at once, so the grid can cover the whole capacity.
- `key_scores`: what SnapKV and R-KV score stored keys by (window attention; R-KV's column sums and
  latest near-duplicates, without the S×S similarity tensor); `compact_`: a compression's in-place
  move of the kept slots.

Lengths are clamped to the capacity: rows past the live batch in a padded graph bucket keep
growing without writing out of bounds.
"""

from __future__ import annotations

from typing import NamedTuple

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


# Compression's key pass: at most _KEY_CHUNKS programs per (row, KV head), each over about
# _KEY_CHUNK keys in tiles of _KEY_BLOCK: one program per row and head left the pass latency-bound
# (bench/results/key-pass-sweep-h100.json: 28 layers of R-KV scores at batch 8 4.5 -> 4.0 ms, at 1.7B
# batch 59 51 -> 41 ms). The scores pass takes _SCORES_BLOCK keys a program.
_KEY_CHUNK, _KEY_CHUNKS = 256, 16
_KEY_BLOCK = 64
_SCORES_BLOCK = 64


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
    def _window_scores(q, k, s, rows_ok, query_slot, scale, PRECISION: tl.constexpr):
        """Scores of the window queries q [R, D] on keys k [BLOCK, D] at slots s, rounded as
        attention_weights.grouped_probs rounds them (product and scaling in the cache's dtype),
        and which of them each query sees (causal: a key up to the query's own slot)."""
        dot = tl.dot(q, tl.trans(k), input_precision=PRECISION)
        scores = (dot.to(k.dtype).to(tl.float32) * scale).to(k.dtype).to(tl.float32)
        visible = rows_ok[:, None] & (s[None, :] <= query_slot[:, None])
        return scores, visible

    @triton.jit
    def _window_queries(q_ptr, b, h, q_next, sq_b, sq_h, sq_w, length,
                        G: tl.constexpr, W: tl.constexpr, R: tl.constexpr, D: tl.constexpr):
        """The G·W window queries of KV head h (query heads h·G ... h·G + G − 1, oldest first in
        the ring that starts at q_next) -> (q [R, D], rows in use, the slot of each query's token)."""
        r = tl.arange(0, R)
        rows_ok = r < G * W
        w = r % W
        d = tl.arange(0, D)
        head = h * G + r // W
        q = tl.load(q_ptr + b * sq_b + head[:, None] * sq_h + ((q_next + w) % W)[:, None] * sq_w + d[None, :],
                    mask=rows_ok[:, None], other=0.0)
        return q, rows_ok, length - W + w

    @triton.jit
    def _key_pass_kernel(k_ptr, len_ptr, q_ptr, m_ptr, l_ptr, inv_ptr, total_ptr, q_next, scale, sk_b, sk_h,
                         sk_s, sq_b, sq_h, sq_w, span, n_heads, chunk, G: tl.constexpr, W: tl.constexpr,
                         R: tl.constexpr, D: tl.constexpr, BLOCK: tl.constexpr, REDUNDANCY: tl.constexpr,
                         PRECISION: tl.constexpr):
        # One (row, KV head) and one chunk of its stored keys a program: each window query's
        # softmax maximum and sum over the chunk (online); for R-KV also 1 / (|k| + 1e-8) of each
        # key and the chunk's sum of unit keys (key_scores merges the chunks).
        pid = tl.program_id(0)
        part = pid * tl.num_programs(1) + tl.program_id(1)
        b = pid // n_heads
        h = pid % n_heads
        length = tl.load(len_ptr + b).to(tl.int32)
        start = tl.program_id(1) * chunk
        end = tl.minimum(start + chunk, length)
        d = tl.arange(0, D)
        base = k_ptr + b * sk_b + h * sk_h
        q, rows_ok, query_slot = _window_queries(q_ptr, b, h, q_next, sq_b, sq_h, sq_w, length, G, W, R, D)
        m = tl.full([R], float("-inf"), tl.float32)
        l_sum = tl.zeros([R], tl.float32)
        total = tl.zeros([D], tl.float32)
        for s0 in range(start, end, BLOCK):
            s = s0 + tl.arange(0, BLOCK)
            ok = s < end
            k = tl.load(base + s[:, None] * sk_s + d[None, :], mask=ok[:, None], other=0.0)
            scores, visible = _window_scores(q, k, s, rows_ok, query_slot, scale, PRECISION)
            m_new = tl.maximum(m, tl.max(tl.where(visible, scores, float("-inf")), 1))
            m_safe = tl.where(m_new == float("-inf"), 0.0, m_new)  # no key seen yet: no -inf - -inf
            alpha = tl.exp(m - m_safe)
            p = tl.where(visible, tl.exp(scores - m_safe[:, None]), 0.0)
            l_sum = l_sum * alpha + tl.sum(p, 1)
            m = m_new
            if REDUNDANCY:
                kf = k.to(tl.float32)
                inv = tl.where(ok, 1.0 / (tl.sqrt(tl.sum(kf * kf, 1)) + 1e-8), 0.0)
                tl.store(inv_ptr + pid * span + s, inv, mask=ok)
                total += tl.sum(kf * inv[:, None], 0)
        r = tl.arange(0, R)
        tl.store(m_ptr + part * R + r, m)
        tl.store(l_ptr + part * R + r, l_sum)
        if REDUNDANCY:
            tl.store(total_ptr + part * D + d, total)

    @triton.jit
    def _duplicate_tile(ki, inv_i, i, kj, inv_j, j, threshold, best_row, latest_row,
                        DIAGONAL: tl.constexpr, PRECISION: tl.constexpr):
        """One tile of key pairs (i, j > i): the rows' latest later near-duplicate, and for each
        column j its latest earlier one, which an atomic max merges across programs. Free slots
        have inverse norm 0, so cosine 0, never above the threshold (>= 0)."""
        # Scaled by the columns' norms only: a row's largest cosine is its largest scaled dot times
        # its own (positive) inverse norm, so the skip test costs one product per pair, not two.
        scaled = tl.dot(ki, tl.trans(kj), input_precision=PRECISION) * inv_j[None, :]
        if DIAGONAL:
            scaled = tl.where(j[None, :] > i[:, None], scaled, 0.0)
        # Most tiles of unrelated keys hold no near-duplicate: one max instead of the two index
        # reductions and the atomics (the 28 layers of a 0.6B batch-112 cache of random keys on an
        # H100: 25 -> 18 ms, bench/results/duplicate-sweep-h100.json); a tile with a hit costs both.
        if tl.max(tl.max(scaled, 1) * inv_i, 0) > threshold:
            hit = scaled * inv_i[:, None] > threshold
            best_row = tl.maximum(best_row, tl.max(tl.where(hit, j[None, :], -1), 1))
            best_col = tl.max(tl.where(hit, i[:, None], -1), 0)
            tl.atomic_max(latest_row + j, best_col, mask=best_col >= 0, sem="relaxed")
        return best_row

    @triton.jit
    def _latest_duplicate_kernel(k_ptr, inv_ptr, len_ptr, latest_ptr, sk_b, sk_h, sk_s, span, n_heads,
                                 threshold, D: tl.constexpr, BLOCK: tl.constexpr, PRECISION: tl.constexpr):
        # Program (row and head, block of keys i): the pairs (i, j) with j in this block or later,
        # each once (the cosine is symmetric), so half the dot products of the full S×S.
        pid = tl.program_id(0)
        b = pid // n_heads
        h = pid % n_heads
        length = tl.load(len_ptr + b).to(tl.int32)
        i0 = (tl.num_programs(1) - 1 - tl.program_id(1)) * BLOCK  # longest rows of pairs first
        if i0 >= length:
            return
        d = tl.arange(0, D)
        base = k_ptr + b * sk_b + h * sk_h
        latest_row = latest_ptr + pid * span
        i = i0 + tl.arange(0, BLOCK)
        ki = tl.load(base + i[:, None] * sk_s + d[None, :], mask=(i < length)[:, None], other=0.0)
        inv_i = tl.load(inv_ptr + pid * span + i, mask=i < length, other=0.0)
        best_row = tl.full([BLOCK], -1, tl.int32)
        best_row = _duplicate_tile(ki, inv_i, i, ki, inv_i, i, threshold, best_row, latest_row,
                                   DIAGONAL=True, PRECISION=PRECISION)
        for j0 in range(i0 + BLOCK, length, BLOCK):
            j = j0 + tl.arange(0, BLOCK)
            kj = tl.load(base + j[:, None] * sk_s + d[None, :], mask=(j < length)[:, None], other=0.0)
            inv_j = tl.load(inv_ptr + pid * span + j, mask=j < length, other=0.0)
            best_row = _duplicate_tile(ki, inv_i, i, kj, inv_j, j, threshold, best_row, latest_row,
                                       DIAGONAL=False, PRECISION=PRECISION)
        tl.atomic_max(latest_row + i, best_row, mask=best_row >= 0, sem="relaxed")

    @triton.jit
    def _key_scores_kernel(k_ptr, len_ptr, q_ptr, m_ptr, l_ptr, inv_ptr, total_ptr, latest_ptr,
                           importance_ptr, column_ptr, value_ptr, q_next, scale, sk_b, sk_h, sk_s, sq_b, sq_h,
                           sq_w, span, n_heads,
                           G: tl.constexpr, W: tl.constexpr, R: tl.constexpr, D: tl.constexpr,
                           BLOCK: tl.constexpr, REDUNDANCY: tl.constexpr, PRECISION: tl.constexpr):
        # Per stored key j: the window queries' mean softmax weight on it (0 for the window's own
        # keys); for R-KV also Σ_{i≠j} k̂_i·k̂_j = k̂_j·Σ_i k̂_i − |k̂_j|² and the cosine with its latest
        # near-duplicate (the entry R-KV drops from that duplicate's column).
        pid = tl.program_id(0)
        b = pid // n_heads
        h = pid % n_heads
        length = tl.load(len_ptr + b).to(tl.int32)
        d = tl.arange(0, D)
        s = tl.program_id(1) * BLOCK + tl.arange(0, BLOCK)
        ok = s < length
        base = k_ptr + b * sk_b + h * sk_h
        row = pid * span
        k = tl.load(base + s[:, None] * sk_s + d[None, :], mask=ok[:, None], other=0.0)
        q, rows_ok, query_slot = _window_queries(q_ptr, b, h, q_next, sq_b, sq_h, sq_w, length, G, W, R, D)
        scores, visible = _window_scores(q, k, s, rows_ok, query_slot, scale, PRECISION)
        r = tl.arange(0, R)
        m = tl.load(m_ptr + pid * R + r)
        l_sum = tl.load(l_ptr + pid * R + r)
        # A query that sees no key (a prompt shorter than the window) adds 0, as nan_to_num does.
        seen = visible & (l_sum > 0)[:, None]
        p = tl.where(seen, tl.exp(scores - m[:, None]) / tl.where(l_sum > 0, l_sum, 1.0)[:, None], 0.0)
        importance = tl.where(s >= length - W, 0.0, tl.sum(p, 0) / (G * W))
        tl.store(importance_ptr + row + s, importance, mask=s < span)
        if REDUNDANCY:
            kf = k.to(tl.float32)
            inv = tl.load(inv_ptr + row + s, mask=ok, other=0.0)
            total = tl.load(total_ptr + pid * D + d)
            column = inv * tl.sum(kf * total[None, :], 1) - inv * inv * tl.sum(kf * kf, 1)
            latest = tl.load(latest_ptr + row + s, mask=ok, other=-1)
            has = ok & (latest >= 0)
            kl = tl.load(base + latest[:, None] * sk_s + d[None, :], mask=has[:, None], other=0.0)
            inv_l = tl.load(inv_ptr + row + latest, mask=has, other=0.0)
            tl.store(column_ptr + row + s, column, mask=s < span)
            tl.store(value_ptr + row + s, tl.sum(kf * kl.to(tl.float32), 1) * inv * inv_l, mask=s < span)

    @triton.jit
    def _compact_kernel(k_ptr, v_ptr, pos_ptr, kept_ptr, sk_b, sk_h, sk_s, sp_b, sp_h, span, n_heads,
                        D: tl.constexpr, BLOCK: tl.constexpr):
        # One (row, head) a program, in place: kept slot s moves to the number of kept slots before
        # it. Destinations are never after sources, so a tile's stores can only land on slots this
        # program has read already (earlier tiles) or reads in this tile (the barrier between).
        pid = tl.program_id(0)
        b = pid // n_heads
        h = pid % n_heads
        d = tl.arange(0, D)
        kbase = k_ptr + b * sk_b + h * sk_h
        vbase = v_ptr + b * sk_b + h * sk_h
        pbase = pos_ptr + b * sp_b + h * sp_h
        count = tl.full([], 0, tl.int32)  # kept slots before this tile
        for s0 in range(0, span, BLOCK):
            s = s0 + tl.arange(0, BLOCK)
            keep = tl.load(kept_ptr + pid * span + s, mask=s < span, other=0).to(tl.int32)
            dst = count + tl.cumsum(keep, 0) - 1
            move = (keep != 0) & (dst != s)
            kk = tl.load(kbase + s[:, None] * sk_s + d[None, :], mask=move[:, None])
            vv = tl.load(vbase + s[:, None] * sk_s + d[None, :], mask=move[:, None])
            pp = tl.load(pbase + s, mask=move)
            tl.debug_barrier()
            tl.store(kbase + dst[:, None] * sk_s + d[None, :], kk, mask=move[:, None])
            tl.store(vbase + dst[:, None] * sk_s + d[None, :], vv, mask=move[:, None])
            tl.store(pbase + dst, pp, mask=move)
            count += tl.sum(keep, 0)

    @triton.jit
    def _greedy_kernel(logits_ptr, token_ptr, logprob_ptr, stride, vocab, BLOCK: tl.constexpr):
        # One row a program, one pass over its logits: the first maximum and the log-sum-exp (online,
        # fp32), instead of an fp32 copy, a log-softmax written out and an argmax over it.
        row = tl.program_id(0)
        base = logits_ptr + row.to(tl.int64) * stride
        v = tl.arange(0, BLOCK)
        x = tl.load(base + v, mask=v < vocab, other=float("-inf")).to(tl.float32)
        best = tl.max(x, 0)
        best_index = tl.argmax(x, 0, tie_break_left=True).to(tl.int64)
        m = best
        total = tl.sum(tl.exp(x - m), 0)
        for v0 in range(BLOCK, vocab, BLOCK):
            x = tl.load(base + v0 + v, mask=v0 + v < vocab, other=float("-inf")).to(tl.float32)
            tile_max = tl.max(x, 0)
            tile_index = tl.argmax(x, 0, tie_break_left=True).to(tl.int64) + v0
            best_index = tl.where(tile_max > best, tile_index, best_index)  # earlier tiles win ties
            best = tl.maximum(best, tile_max)
            m_new = tl.maximum(m, tile_max)
            total = total * tl.exp(m - m_new) + tl.sum(tl.exp(x - m_new), 0)
            m = m_new
        tl.store(token_ptr + row, best_index)
        tl.store(logprob_ptr + row, best - (m + tl.log(total)))

    @triton.jit
    def _sample_kernel(logits_ptr, u_ptr, token_ptr, logprob_ptr, stride, vocab, temperature,
                       BLOCK: tl.constexpr):
        # One row a program, inverse-CDF over softmax(logits / T) with the row's uniform u, in three
        # reads of the logits (maximum; sum; the tile where the running sum passes u · sum) instead
        # of ~10 passes over an fp32 [B, V] copy. The running sum adds the same per-tile sums as the
        # total, in the same order, so it always passes u · total within the vocabulary.
        row = tl.program_id(0)
        base = logits_ptr + row.to(tl.int64) * stride
        v = tl.arange(0, BLOCK)
        m = tl.max(tl.load(base + v, mask=v < vocab, other=float("-inf")).to(tl.float32) / temperature, 0)
        for v0 in range(BLOCK, vocab, BLOCK):
            x = tl.load(base + v0 + v, mask=v0 + v < vocab, other=float("-inf")).to(tl.float32) / temperature
            m = tl.maximum(m, tl.max(x, 0))
        total = 0.0
        for v0 in range(0, vocab, BLOCK):
            x = tl.load(base + v0 + v, mask=v0 + v < vocab, other=float("-inf")).to(tl.float32) / temperature
            total += tl.sum(tl.exp(x - m), 0)
        target = tl.load(u_ptr + row) * total
        carry = 0.0
        token = tl.full([], -1, tl.int32)
        v0 = 0
        while (token < 0) & (v0 < vocab):
            x = tl.load(base + v0 + v, mask=v0 + v < vocab, other=float("-inf")).to(tl.float32) / temperature
            p = tl.exp(x - m)
            tile = tl.sum(p, 0)
            if carry + tile > target:
                # The first slot whose running sum passes the target (searchsorted, right=True); the
                # in-tile prefix sums round differently from `tile`, so fall back to the tile's last
                # slot with mass.
                first = tl.min(tl.where(carry + tl.cumsum(p, 0) > target, v, BLOCK), 0)
                last = tl.max(tl.where(p > 0, v, -1), 0)
                token = v0 + tl.where(first < BLOCK, first, last)
            carry += tile
            v0 += BLOCK
        token = tl.where(token < 0, vocab - 1, token)  # NaN logits pass no target: the last slot, as torch
        x_token = tl.load(base + token).to(tl.float32) / temperature
        tl.store(token_ptr + row, token.to(tl.int64))
        tl.store(logprob_ptr + row, x_token - (m + tl.log(total)))

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


class KeyScores(NamedTuple):
    """What the scoring policies need of one layer's stored keys ([B, H, S] each, fp32 unless said)."""

    importance: torch.Tensor  # mean softmax weight of the window queries (policies.window_attention)
    column: torch.Tensor | None  # R-KV: Σ_{i≠j} k̂_i·k̂_j for each stored key j (k̂ = k / (|k| + 1e-8))
    latest: torch.Tensor | None  # R-KV: the latest other key with cosine > threshold, -1 if none (int32)
    value: torch.Tensor | None  # R-KV: that cosine (0 if none)


def key_scores(keys: torch.Tensor, lengths: torch.Tensor, queries: torch.Tensor, q_next: int,
               threshold: float | None) -> KeyScores:
    """Score keys [B, H, S, D] (row b stores lengths[b] keys) by the window queries [B, H·G, W, D]
    (a ring whose oldest query sits at q_next), as policies.window_attention does; with a threshold
    (>= 0) also R-KV's redundancy terms, without the S×S similarity tensor. Two passes over the
    keys (softmax statistics and norms, then the scores) and, for R-KV, one over the key pairs,
    each once. Cosines from the tensor-core dot of the stored keys (fp32 accumulate) and fp32
    norms; attention scores rounded as grouped_probs rounds them; the rest in fp32."""
    b, heads, span, dim = keys.shape
    window, group = queries.shape[2], queries.shape[1] // heads
    rows = max(16, triton.next_power_of_2(group * window))  # tl.dot wants 16 rows or more
    assert keys.stride(-1) == 1 and queries.stride(-1) == 1
    dev, f32 = keys.device, torch.float32
    redundancy = threshold is not None
    # The key pass cuts each row's keys into chunks, so that a batch of few rows still fills the GPU.
    chunks = max(1, min(_KEY_CHUNKS, triton.cdiv(span, _KEY_CHUNK)))
    chunk = triton.cdiv(triton.cdiv(span, chunks), _KEY_BLOCK) * _KEY_BLOCK
    chunks = triton.cdiv(span, chunk)
    parts = torch.empty((2, b * heads, chunks, rows), dtype=f32, device=dev)
    inv = torch.empty((b, heads, span), dtype=f32, device=dev) if redundancy else parts
    total = torch.empty((b * heads, chunks, dim), dtype=f32, device=dev) if redundancy else parts
    common = dict(G=group, W=window, R=rows, D=dim, REDUNDANCY=redundancy, PRECISION=_precision(keys.dtype))
    strides = (*keys.stride()[:3], *queries.stride()[:3])
    scale = dim ** -0.5
    _key_pass_kernel[(b * heads, chunks)](keys, lengths, queries, parts[0], parts[1], inv, total, q_next,
                                          scale, *strides, span, heads, chunk, BLOCK=_KEY_BLOCK, num_warps=4,
                                          **common)
    # The chunks merged: each query's softmax maximum over them and its sum rescaled to it (a chunk
    # with no key it sees holds -inf and 0).
    m = parts[0].amax(dim=1)
    rescale = (parts[0] - m.nan_to_num(neginf=0.0)[:, None]).exp_()
    stats = torch.stack((m, (parts[1] * rescale).sum(dim=1)))
    total = total.sum(dim=1) if redundancy else total
    latest = column = value = None
    if threshold is not None:
        latest = torch.full((b, heads, span), -1, dtype=torch.int32, device=dev)
        # bf16: 128 keys a side, 4 warps: bench/results/duplicate-sweep-h100.json (64-128 keys x
        # 4/8 warps x 2/3 stages, and a full S×S variant without atomics: 1.2-2x slower); fp32
        # operands (tests) fit shared memory at 64.
        block = 128 if keys.dtype == torch.bfloat16 else 64
        _latest_duplicate_kernel[(b * heads, -(-span // block))](
            keys, inv, lengths, latest, *keys.stride()[:3], span, heads, threshold, D=dim, BLOCK=block,
            PRECISION=_precision(keys.dtype), num_warps=4, num_stages=2)
        column, value = torch.empty_like(inv), torch.empty_like(inv)
    importance = torch.empty((b, heads, span), dtype=f32, device=dev)
    _key_scores_kernel[(b * heads, -(-span // _SCORES_BLOCK))](
        keys, lengths, queries, stats[0], stats[1], inv, total, latest if latest is not None else stats,
        importance, column if column is not None else stats, value if value is not None else stats, q_next,
        scale, *strides, span, heads, BLOCK=_SCORES_BLOCK, num_warps=4, **common)
    return KeyScores(importance, column, latest, value)


def compact_(k: torch.Tensor, v: torch.Tensor, positions: torch.Tensor, kept: torch.Tensor) -> None:
    """Move each (row, head)'s kept slots to its front, in their order, in place: k/v [B, H, cap, D],
    positions [B, H, cap] int32, kept [B, H, S] bool (S <= cap). Slots past the kept ones keep what
    they held. Reads and writes only the slots that move, once."""
    b, heads, span = kept.shape
    assert k.stride() == v.stride() and k.stride(-1) == 1 and positions.stride(-1) == 1
    assert kept.is_contiguous()
    _compact_kernel[(b * heads,)](
        k, v, positions, kept.view(torch.int8), k.stride(0), k.stride(1), k.stride(2), positions.stride(0),
        positions.stride(1), span, heads, D=k.shape[-1], BLOCK=32, num_warps=4, num_stages=1)


def greedy(logits: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """logits [B, V] -> (argmax [B] int64, log_softmax(logits.float())[argmax] [B] fp32), one kernel:
    sampler.sample's greedy case on CUDA. A row with a NaN logit gets a NaN log-prob (its token, in
    the vocabulary, is not torch.argmax's NaN slot)."""
    b, vocab = logits.shape
    assert logits.stride(-1) == 1
    tokens = torch.empty(b, dtype=torch.long, device=logits.device)
    logprobs = torch.empty(b, dtype=torch.float32, device=logits.device)
    _greedy_kernel[(b,)](logits, tokens, logprobs, logits.stride(0), vocab, BLOCK=4096, num_warps=8,
                         num_stages=3)
    return tokens, logprobs


def sample(logits: torch.Tensor, uniforms: torch.Tensor,
           temperature: float) -> tuple[torch.Tensor, torch.Tensor]:
    """logits [B, V], uniforms [B] in [0, 1), temperature > 0 -> (tokens [B] int64, fp32
    log_softmax(logits / temperature)[token] [B]): sampler.sample's unfiltered case (top_k = 0,
    top_p = 1) on CUDA, the same inverse-CDF draw up to fp32 rounding."""
    b, vocab = logits.shape
    assert logits.stride(-1) == 1 and temperature > 0
    tokens = torch.empty(b, dtype=torch.long, device=logits.device)
    logprobs = torch.empty(b, dtype=torch.float32, device=logits.device)
    _sample_kernel[(b,)](logits, uniforms.float().contiguous(), tokens, logprobs, logits.stride(0), vocab,
                         float(temperature), BLOCK=4096, num_warps=8, num_stages=3)
    return tokens, logprobs


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
