"""KV eviction policies: each scores the stored tokens of one layer; higher = keep.

The cache (kv_cache.KVCache.compress) does the rest for every policy alike: the protected prompt
(keep_prompt), the `window` most recent tokens and a policy's own must-keep tokens score +inf,
empty slots -inf, and each (row, KV head) keeps its `protected + budget` best tokens.

Sources (docs/engine.md has the formulas):
- streaming: StreamingLLM (Xiao et al. 2023): attention sinks + recent tokens.
- snapkv: SnapKV (Li et al. 2024): attention of an observation window of recent queries,
  pooled over neighbouring keys.
- h2o: H2O (Zhang et al. 2023): attention accumulated over all decode queries ("heavy hitters").
- rkv: R-KV (Cai et al. 2025) as run by Sparse-RL (arXiv 2601.10079): λ·importance − (1−λ)·redundancy.
"""

from __future__ import annotations

from typing import Protocol

import torch
import torch.nn.functional as F

import services.rollout.engine.kernels as kernels
from services.rollout.engine.attention_weights import grouped_probs
from services.rollout.engine.config import KVConfig


class KVCache(Protocol):
    """What a policy reads of the cache (kv_cache.KVCache has it); no import of the cache, which
    imports the policies."""

    k: list[torch.Tensor]  # per layer [B, Hkv, capacity, D]
    positions: torch.Tensor
    lengths_t: torch.Tensor  # [layers, B]
    attn_acc: torch.Tensor | None
    q_window: torch.Tensor | None  # [layers, B, Hq, window, D], a ring whose oldest query is at q_next
    q_next: int

    def window_queries(self, layer: int) -> torch.Tensor: ...

# Bound on the [rows, heads, S, S] similarity tensor R-KV builds per step of its batch loop.
_SIMILARITY_BYTES = 256 << 20


class EvictionPolicy:
    name = "dense"
    uses_query_window = False
    uses_accumulated_attention = False

    def __init__(self, kv: KVConfig) -> None:
        self.kv = kv

    def score(self, cache: KVCache, layer: int, span: int, valid: torch.Tensor) -> torch.Tensor:
        """Scores [B, Hkv or 1, span] of stored tokens; valid [B, span] marks stored slots."""
        raise NotImplementedError("dense never evicts")


class Streaming(EvictionPolicy):
    name = "streaming"

    def score(self, cache: KVCache, layer: int, span: int, valid: torch.Tensor) -> torch.Tensor:
        positions = cache.positions[layer, :, :1, :span].float()  # identical in every head
        return positions.masked_fill(positions < self.kv.sink_tokens, float("inf"))


class SnapKV(EvictionPolicy):
    name = "snapkv"
    uses_query_window = True

    def score(self, cache: KVCache, layer: int, span: int, valid: torch.Tensor) -> torch.Tensor:
        importance, _ = layer_scores(cache, layer, span, valid, None)
        return pool(importance, self.kv)


class H2O(EvictionPolicy):
    name = "h2o"
    uses_accumulated_attention = True

    def score(self, cache: KVCache, layer: int, span: int, valid: torch.Tensor) -> torch.Tensor:
        assert cache.attn_acc is not None
        return cache.attn_acc[layer, :, :, :span]


class RKV(EvictionPolicy):
    name = "rkv"
    uses_query_window = True

    def score(self, cache: KVCache, layer: int, span: int, valid: torch.Tensor) -> torch.Tensor:
        importance, redundancy = layer_scores(cache, layer, span, valid, self.kv.similarity_threshold)
        assert redundancy is not None
        lam = self.kv.mix_lambda
        return lam * pool(importance, self.kv) - (1.0 - lam) * redundancy


POLICIES: dict[str, type[EvictionPolicy]] = {
    "dense": EvictionPolicy, "streaming": Streaming, "snapkv": SnapKV, "h2o": H2O, "rkv": RKV,
}


def make_policy(kv: KVConfig) -> EvictionPolicy:
    return POLICIES[kv.policy](kv)


def window_attention(cache: KVCache, layer: int, span: int) -> torch.Tensor:
    """Mean softmax attention of the last `window` queries over the stored keys -> fp32 [B, Hkv, S].

    Averaged over the window's queries and over the query heads sharing a KV head. Each window
    query sees only keys up to its own token (causal). The window's own keys get 0: they are kept
    anyway, and (as in SnapKV / R-KV, which score only the keys before the window) must not
    lend their attention to neighbours through pooling.
    """
    q = cache.window_queries(layer)  # [B, Hq, W, D], oldest first
    keys = cache.k[layer][:, :, :span]
    b, _, w, d = q.shape
    lengths = cache.lengths_t[layer][:, None]
    slot = torch.arange(span, device=q.device)
    # Window query j is the token at slot lengths - w + j.
    last_visible = lengths - w + torch.arange(w, device=q.device)[None]  # [B, W]
    mask = slot[None, None, :] <= last_visible[:, :, None]  # [B, W, S]
    probs = grouped_probs(q, keys, mask[:, None, None])  # [B, Hkv, G, W, S]
    probs = probs.nan_to_num(0.0)  # a query with no visible key (prompt shorter than the window)
    scores = probs.mean(dim=(2, 3))
    return scores.masked_fill((slot[None] >= lengths - w)[:, None], 0.0)


def pool(scores: torch.Tensor, kv: KVConfig) -> torch.Tensor:
    """Pool importance over neighbouring keys (kernel `kv.kernel`, stride 1, same length)."""
    b, h, s = scores.shape
    flat = scores.reshape(b * h, 1, s)
    pad = kv.kernel // 2
    if kv.pooling == "max":
        out = F.max_pool1d(flat, kv.kernel, stride=1, padding=pad)
    else:
        out = F.avg_pool1d(flat, kv.kernel, stride=1, padding=pad, count_include_pad=False)
    return out.view(b, h, s)


def key_redundancy(keys: torch.Tensor, valid: torch.Tensor, threshold: float) -> torch.Tensor:
    """R-KV redundancy of each stored key -> fp32 [B, Hkv, S], a softmax over each row's keys.

    Cosine similarity between the keys of a head (self-similarity 0). Each key i drops its entry
    (i, j) for j = its most recent near-duplicate (cosine > threshold); key j's redundancy is then
    the mean of column j over the stored keys, softmaxed over keys. The column mean is R-KV's axis
    (upstream `cal_similarity`: `mean(dim=-2)`): every older copy of a repeated key zeroes its entry
    in the *newest* copy's column, so the newest copy comes out least redundant and survives.
    """
    b, h, s, _ = keys.shape
    out = torch.empty((b, h, s), dtype=torch.float32, device=keys.device)
    # fp32 slot numbers (exact below 2^24): the where/amax below then moves 4 bytes per pair
    # instead of int64's 8, on the largest tensor of a compression.
    slot = torch.arange(s, device=keys.device, dtype=torch.float32)
    step = max(1, _SIMILARITY_BYTES // (h * s * s * 4))
    for start in range(0, b, step):
        k = keys[start:start + step].float()
        ok = valid[start:start + step]
        # Free slots get a zero key, so their similarity columns come out 0 from the matmul: a
        # mask on [S, D] instead of on the S×S similarities.
        k = (k / (k.norm(dim=-1, keepdim=True) + 1e-8)).masked_fill_(~ok[:, None, :, None], 0.0)
        sim = torch.matmul(k, k.transpose(-1, -2))  # [b, H, S, S]
        sim.diagonal(dim1=-2, dim2=-1).zero_()
        latest = torch.where(sim > threshold, slot, -1.0).amax(dim=-1, keepdim=True)  # [b, H, S, 1]
        has = latest >= 0
        idx = latest.clamp(min=0).long()
        sim.scatter_(-1, idx, torch.where(has, 0.0, sim.gather(-1, idx)))
        mean = sim.sum(dim=-2) / ok.sum(dim=-1).clamp(min=1)[:, None, None]  # column j: redundancy of key j
        out[start:start + step] = mean.masked_fill(~ok[:, None], float("-inf")).softmax(dim=-1)
    return out


def layer_scores(cache: KVCache, layer: int, span: int, valid: torch.Tensor,
                 threshold: float | None) -> tuple[torch.Tensor, torch.Tensor | None]:
    """window_attention and, with a threshold, key_redundancy of one layer's stored keys: in Triton
    on CUDA (kernels.key_scores; the same quantities up to fp32 rounding), else these torch ops.

    On CUDA, column j's redundancy sum over the other keys is k̂_j·Σ_i k̂_i − |k̂_j|² (k̂: unit keys,
    free slots 0); the near-duplicate entries R-KV drops come from one pass over the key pairs that
    keeps, per key, only its latest near-duplicate and their cosine, and are subtracted from their
    columns.
    """
    keys = cache.k[layer][:, :, :span]
    if not (keys.is_cuda and kernels.available()):
        redundancy = None if threshold is None else key_redundancy(keys, valid, threshold)
        return window_attention(cache, layer, span), redundancy
    assert cache.q_window is not None
    lengths = cache.lengths_t[layer]
    scores = kernels.key_scores(keys, lengths, cache.q_window[layer], cache.q_next, threshold)
    if scores.column is None or scores.latest is None or scores.value is None:
        return scores.importance, None
    column, latest = scores.column, scores.latest
    column.scatter_add_(-1, latest.clamp(min=0).long(), torch.where(latest >= 0, -scores.value, 0.0))
    mean = column / lengths.clamp(min=1)[:, None, None]
    return scores.importance, mean.masked_fill(~valid[:, None], float("-inf")).softmax(dim=-1)
