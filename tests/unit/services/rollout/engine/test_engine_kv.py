"""The compacting KV cache and the eviction policies."""

from __future__ import annotations

import pytest
import torch

from services.rollout.engine import KVConfig, LLMEngine, SamplingParams
from services.rollout.engine.attention import CacheAttention
from services.rollout.engine.config import layer_budgets
from services.rollout.engine.kv_cache import REUSE_SLACK, KVCache, StaticStorage, layer_capacities
from services.rollout.engine.policies import key_redundancy
from tests.unit.services.rollout.engine.engine_helpers import one_thread, tiny_config

_one_thread = pytest.fixture(autouse=True)(one_thread)

HEADS, KV_HEADS, DIM, LAYERS = 4, 2, 8, 2


def _drive(kv: KVConfig, prompt_lengths: list[int], steps: int, seed: int = 0,
           keys: torch.Tensor | None = None, layers: int = LAYERS, compress: bool = True) -> KVCache:
    """Run a cache through prefill and `steps` decode steps with random q/k/v, compressing as the engine
    does (unless `compress` is False)."""
    gen = torch.Generator().manual_seed(seed)
    batch, width = len(prompt_lengths), max(prompt_lengths)
    cache = KVCache(num_layers=layers, num_heads=HEADS, num_kv_heads=KV_HEADS, head_dim=DIM,
                    prompt_lengths=prompt_lengths,
                    capacity=layer_capacities(prompt_lengths, steps, kv, layers), kv=kv,
                    dtype=torch.float32, device=torch.device("cpu"))
    attention = CacheAttention(cache)
    attention.begin_prefill(width)
    for layer in range(layers):
        q = torch.randn(batch, HEADS, width, DIM, generator=gen)
        k, v = torch.randn(2, batch, KV_HEADS, width, DIM, generator=gen)
        attention.prefill(layer, q, k, v)
    if cache.needs_compression():
        cache.compress()
    positions = torch.tensor(prompt_lengths)
    for step in range(steps):
        attention.begin_decode(positions)
        for layer in range(layers):
            q = torch.randn(batch, HEADS, 1, DIM, generator=gen)
            k = torch.randn(batch, KV_HEADS, 1, DIM, generator=gen) if keys is None else keys[step].expand(
                batch, KV_HEADS, 1, DIM)
            attention.decode(layer, q, k, torch.randn(batch, KV_HEADS, 1, DIM, generator=gen))
        attention.end_decode()
        positions = positions + 1
        for layer in range(layers):
            assert max(cache.layer_lengths(layer)) <= cache.capacities[layer] == cache.k[layer].shape[2]
        if compress and cache.needs_compression():
            cache.compress()
    return cache


def _kept_positions(cache: KVCache, row: int, layer: int = 0, head: int = 0) -> list[int]:
    return cache.positions[layer, row, head, : cache.layer_lengths(layer)[row]].tolist()


def test_streaming_keeps_sinks_and_the_recent_window() -> None:
    kv = KVConfig(policy="streaming", budget=12, buffer=5, sink_tokens=4, keep_prompt=False)
    cache = _drive(kv, [3, 6], steps=40)
    for row, prompt_len in enumerate([3, 6]):
        total = prompt_len + 40
        stored = cache.lengths[row]
        assert 12 <= stored < 12 + 5
        recent = list(range(total - (stored - 4), total))
        for layer in range(LAYERS):
            for head in range(KV_HEADS):
                assert _kept_positions(cache, row, layer, head) == [0, 1, 2, 3] + recent


def test_keep_prompt_protects_the_prompt_and_budgets_generated_tokens() -> None:
    kv = KVConfig(policy="streaming", budget=10, buffer=4, sink_tokens=2)
    cache = _drive(kv, [20, 7], steps=50)
    for row, prompt_len in enumerate([20, 7]):
        kept = _kept_positions(cache, row)
        assert kept[:prompt_len] == list(range(prompt_len))
        generated = kept[prompt_len:]
        assert 10 <= len(generated) < 14
        assert generated == list(range(prompt_len + 50 - len(generated), prompt_len + 50))


@pytest.mark.parametrize("policy", ["snapkv", "h2o", "rkv"])
def test_scoring_policies_keep_window_and_prompt_and_evict_per_head(policy: str) -> None:
    kv = KVConfig(policy=policy, budget=16, buffer=8, window=8)
    cache = _drive(kv, [5, 9], steps=60, seed=3)
    differs = False
    for row, prompt_len in enumerate([5, 9]):
        total, stored = prompt_len + 60, cache.lengths[row]
        assert stored == prompt_len + 16 + (60 - 24) % 8
        for layer in range(LAYERS):
            for head in range(KV_HEADS):
                kept = _kept_positions(cache, row, layer, head)
                assert kept == sorted(set(kept))  # chronological, no duplicates
                assert kept[:prompt_len] == list(range(prompt_len))
                assert kept[-8:] == list(range(total - 8, total))
            differs |= _kept_positions(cache, row, layer, 0) != _kept_positions(cache, row, layer, 1)
    assert differs  # per-head selection


def test_compaction_moves_keys_and_values_with_their_positions() -> None:
    kv = KVConfig(policy="snapkv", budget=8, buffer=4, keep_prompt=False)
    # Key = its logical position in every coordinate: after compaction each slot must still match.
    keys = torch.arange(100, dtype=torch.float32)[:, None, None, None, None].expand(100, 1, 1, 1, DIM) + 3
    cache = _drive(kv, [3], steps=40, keys=keys)
    n = cache.lengths[0]
    positions = cache.positions[:, 0, :, :n].float()
    assert torch.equal(torch.stack([k[0, :, :n, 0] for k in cache.k]), positions)


def test_h2o_keeps_the_heaviest_accumulated_attention() -> None:
    kv = KVConfig(policy="h2o", budget=8, buffer=3, window=2, keep_prompt=False)
    cache = _drive(kv, [4], steps=7, compress=False)  # 11 stored = budget + buffer, nothing evicted yet
    assert cache.lengths == [11] and cache.needs_compression()
    acc = cache.attn_acc[:, 0, :, :11]
    lightest = acc[0, 0, :9].argmin().item()
    acc[0, 0, lightest] += 100.0  # make the least-attended token a heavy hitter
    expected = [sorted(acc[layer, head, :9].topk(6).indices.tolist()) + [9, 10]
                for layer in range(LAYERS) for head in range(KV_HEADS)]
    assert cache.compress() == [3]
    kept = [_kept_positions(cache, 0, layer, head) for layer in range(LAYERS) for head in range(KV_HEADS)]
    assert kept == expected and lightest in kept[0]


def test_h2o_prompt_accumulators_count_only_real_queries() -> None:
    kv = KVConfig(policy="h2o", budget=16, buffer=4, keep_prompt=False)
    cache = _drive(kv, [9, 4], steps=0)
    # Each real prompt query spreads a total weight of 1 over the keys it sees; padding adds nothing.
    totals = cache.attn_acc.sum(dim=-1)  # [layers, batch, kv_heads]
    torch.testing.assert_close(totals[:, 0], torch.full((LAYERS, KV_HEADS), 9.0))
    torch.testing.assert_close(totals[:, 1], torch.full((LAYERS, KV_HEADS), 4.0))


def test_rkv_redundancy_penalises_duplicates_and_the_newest_copy_least() -> None:
    torch.manual_seed(0)
    keys = torch.randn(1, 1, 10, 16)
    keys[0, 0, 3] = keys[0, 0, 1] * 2.0  # same direction as key 1
    keys[0, 0, 7] = keys[0, 0, 1] + 0.01 * torch.randn(16)
    valid = torch.ones(1, 10, dtype=torch.bool)
    red = key_redundancy(keys, valid, threshold=0.5)[0, 0]
    assert red.sum().item() == pytest.approx(1.0, abs=1e-5)
    unique = [i for i in range(10) if i not in (1, 3, 7)]
    assert red[1] > max(red[i] for i in unique)
    # R-KV's column mean: both older copies drop their entry in the newest copy's column, the
    # newest drops its entry in the middle one's, the oldest keeps both: oldest > middle > newest.
    assert red[1] > red[3] > red[7]
    # Empty slots get no redundancy mass.
    valid[0, 8:] = False
    assert key_redundancy(keys, valid, 0.5)[0, 0, 8:].abs().max() == 0


def test_rkv_redundancy_keeps_the_newest_copy_of_planted_clusters() -> None:
    """Random keys with planted near-duplicate clusters of 3 copies: the newest copy of a cluster
    must be its least redundant member (R-KV's axis: 97 % in the issue's check, chance is 33 %)."""
    gen = torch.Generator().manual_seed(1)
    newest_least, clusters = 0, 0
    for _ in range(40):
        s, d = 64, 32
        keys = torch.randn(1, 2, s, d, generator=gen)
        slots = torch.randperm(s, generator=gen)[:15].view(5, 3)
        for head in range(2):
            for cluster in slots:
                base = torch.randn(d, generator=gen)
                for slot in cluster:
                    keys[0, head, slot] = base + 0.2 * torch.randn(d, generator=gen)
        red = key_redundancy(keys, torch.ones(1, s, dtype=torch.bool), threshold=0.5)[0]
        for head in range(2):
            for cluster in slots.sort(dim=1).values:
                clusters += 1
                newest_least += int(red[head, cluster].argmin() == 2)
    assert newest_least / clusters >= 0.9, (
        f"newest copy least redundant in {newest_least}/{clusters} clusters"
    )


@pytest.mark.parametrize("policy", ["streaming", "snapkv", "h2o", "rkv"])
def test_kv_memory_bounded_at_four_times_the_budget(policy: str) -> None:
    engine = LLMEngine(tiny_config("qwen3"))
    prompts = [[1, 2, 3, 4], [5, 6]]
    kv = KVConfig(policy=policy, budget=16, buffer=8)
    sizes, outs = [], None
    for gen_len in (32, 64):  # 2x and 4x the budget
        outs = engine.generate(prompts, SamplingParams(temperature=1.0, max_new_tokens=gen_len, seed=0), kv)
        sizes.append(engine.last_batch_kv_bytes)
    assert sizes[0] == sizes[1] == 2 * (4 + 16 + 8) * engine.kv_bytes_per_token()
    dense = engine.generate(prompts, SamplingParams(temperature=1.0, max_new_tokens=64, seed=0), KVConfig())
    assert engine.last_batch_kv_bytes == 2 * (4 + 64) * engine.kv_bytes_per_token()
    for prompt, out, d in zip(prompts, outs, dense, strict=True):
        assert len(out.token_ids) == 64
        assert out.kv.peak_tokens == len(prompt) + 16 + 8
        assert out.kv.peak_bytes == out.kv.peak_tokens * engine.kv_bytes_per_token()
        # 63 decode steps store tokens (the last sample is never fed back); the buffer fills at 24
        # stored generated tokens and then every 8: 5 compressions of 8 tokens.
        assert out.kv.evicted == 5 * 8
        # Dense stores the prompt and every generated token but the last (never fed back).
        assert d.kv.peak_tokens == len(prompt) + 63 and d.kv.evicted == 0


def test_long_prompt_is_compressed_at_prefill_without_keep_prompt() -> None:
    engine = LLMEngine(tiny_config("qwen3"))
    kv = KVConfig(policy="rkv", budget=12, buffer=4, keep_prompt=False)
    out = engine.generate([list(range(1, 31))], SamplingParams(temperature=0.0, max_new_tokens=10), kv)[0]
    assert out.kv.peak_tokens == 30  # the whole prompt is written before it is first cut
    # 30 -> 12 at prefill, then 9 decode steps fill the 4-token buffer twice.
    assert out.kv.evicted == 18 + 4 + 4
    assert engine.last_batch_kv_bytes == 30 * engine.kv_bytes_per_token()


def test_h2o_free_slots_hold_no_evicted_attention() -> None:
    # A token written into a slot freed by compression must start accumulating from zero.
    cache = _drive(KVConfig(policy="h2o", budget=8, buffer=4, window=2), [3, 6], steps=13)
    assert cache.attn_acc is not None
    for row, n in enumerate(cache.lengths):
        assert n < cache.capacity and cache.attn_acc[:, row, :, n:].abs().sum() == 0


# ---------------------------------------------------------------------------- per-layer budgets (PyramidKV)
@pytest.mark.parametrize(("layers", "budget", "policy"), [
    (28, 1024, "rkv"), (28, 512, "snapkv"), (36, 2048, "h2o"), (4, 16, "streaming"), (3, 100, "rkv"),
    (1, 50, "rkv"), (4, 10, "streaming")])
def test_pyramid_budgets_decrease_and_sum_to_layers_times_budget(layers: int, budget: int,
                                                                 policy: str) -> None:
    kv = KVConfig(policy=policy, budget=budget, layer_budgets="pyramid")
    budgets = layer_budgets(kv, layers)
    assert len(budgets) == layers and sum(budgets) == layers * budget
    assert budgets == sorted(budgets, reverse=True) and min(budgets) >= min(budget, kv.min_layer_budget)
    if layers > 1:
        low = min(budget, max(budget / kv.pyramid_beta, kv.min_layer_budget))
        assert budgets[-1] == pytest.approx(low, abs=1)
        assert budgets[0] == pytest.approx(2 * budget - low, abs=1)
        steps = [a - b for a, b in zip(budgets, budgets[1:], strict=False)]
        assert max(steps) - min(steps) <= 1  # arithmetic, up to integer rounding
    assert layer_budgets(KVConfig(policy=policy, budget=budget), layers) == [budget] * layers


def test_pyramid_is_refused_for_dense() -> None:
    with pytest.raises(ValueError, match="evicting policy"):
        KVConfig(layer_budgets="pyramid")


@pytest.mark.parametrize("policy", ["streaming", "snapkv", "h2o", "rkv"])
@pytest.mark.parametrize("keep_prompt", [True, False])
def test_each_layer_keeps_its_own_budget(policy: str, keep_prompt: bool) -> None:
    layers, prompts, steps, buffer = 4, [5, 9], 70, 6
    kv = KVConfig(policy=policy, budget=20, buffer=buffer, window=4, sink_tokens=2, keep_prompt=keep_prompt,
                  layer_budgets="pyramid", pyramid_beta=4)
    budgets = layer_budgets(kv, layers)
    assert budgets == ([34, 25, 15, 6] if policy == "streaming" else [35, 25, 15, 5])
    cache = _drive(kv, prompts, steps=steps, layers=layers, seed=5)
    for layer, budget in enumerate(budgets):
        # Memory per layer: only what the layer's own budget needs.
        assert cache.capacities[layer] == layer_capacities(prompts, steps, kv, layers)[layer]
        for row, prompt_len in enumerate(prompts):
            protected = prompt_len if keep_prompt else 0
            stored = cache.layer_lengths(layer)[row]
            # Compressions run every `buffer` steps once the top layer has filled; each layer is then cut
            # to protected + its budget and grows by at most `buffer` until the next one.
            assert protected + budget <= stored <= protected + budget + buffer
            for head in range(KV_HEADS):
                kept = _kept_positions(cache, row, layer, head)
                total = prompt_len + steps
                assert kept == sorted(set(kept)) and kept[-4:] == list(range(total - 4, total))
                if keep_prompt:
                    assert kept[:prompt_len] == list(range(prompt_len))
    # The rows' mean over layers is what the engine records (stored()).
    for row in range(len(prompts)):
        mean = sum(cache.layer_lengths(layer)[row] for layer in range(layers)) / layers
        assert cache.stored()[row] == int(mean + 0.5)


def test_pyramid_costs_the_memory_of_a_uniform_budget() -> None:
    engine = LLMEngine(tiny_config("qwen3", layers=4))
    params = SamplingParams(temperature=0.0, max_new_tokens=60)
    sizes, evicted = {}, {}
    for spread in ("uniform", "pyramid"):
        kv = KVConfig(policy="rkv", budget=16, buffer=4, layer_budgets=spread, pyramid_beta=4)
        outs = engine.generate([[1, 2, 3], [4, 5, 6, 7, 8]], params, kv)
        sizes[spread], evicted[spread] = engine.last_batch_kv_bytes, [o.kv.evicted for o in outs]
    assert sizes["pyramid"] == sizes["uniform"] == 2 * (5 + 16 + 4) * engine.kv_bytes_per_token()
    # Uniform: every layer evicts 60 - 16 - (60 - 20) % 4 tokens; the pyramid's layers evict more or
    # fewer but as many on average (the top layer's buffer fills first, so compressions start earlier).
    assert evicted["uniform"] == [60 - 1 - 16 - (59 - 20) % 4] * 2
    assert all(abs(p - u) <= 4 for p, u in zip(evicted["pyramid"], evicted["uniform"], strict=True))


def _drive_rows(kv: KVConfig, prompts: list[int], steps: int, leave_at: int, keep: list[int], layers: int,
                storage: StaticStorage | None) -> KVCache:
    """Like _drive, with rows leaving the batch at step leave_at; a static cache's device lengths
    advance as the captured step advances them (StaticStorage.advance)."""
    gen = torch.Generator().manual_seed(7)
    capacities = layer_capacities(prompts, steps, kv, layers)
    cache = KVCache(num_layers=layers, num_heads=HEADS, num_kv_heads=KV_HEADS, head_dim=DIM,
                    prompt_lengths=prompts, capacity=capacities, kv=kv, dtype=torch.float32,
                    device=torch.device("cpu"), storage=storage)
    attention = CacheAttention(cache)
    width = max(prompts)
    attention.begin_prefill(width)
    for layer in range(layers):
        q = torch.randn(len(prompts), HEADS, width, DIM, generator=gen)
        k, v = torch.randn(2, len(prompts), KV_HEADS, width, DIM, generator=gen)
        attention.prefill(layer, q, k, v)
    positions = torch.tensor(prompts)
    for step in range(steps):
        if step == leave_at:
            cache.select_rows(keep)
            positions = positions[keep]
        batch = cache.batch
        attention.begin_decode(positions)
        for layer in range(layers):
            q = torch.randn(batch, HEADS, 1, DIM, generator=gen)
            k, v = torch.randn(2, batch, KV_HEADS, 1, DIM, generator=gen)
            attention.decode(layer, q, k, v)
        attention.end_decode()
        if storage is not None:
            storage.advance(batch)
        positions = positions + 1
        if cache.needs_compression():
            cache.compress()
    return cache


@pytest.mark.parametrize("spread", ["uniform", "pyramid"])
def test_static_storage_keeps_the_eager_cache_and_is_reusable(spread: str) -> None:
    """The CUDA-graph cache's bookkeeping on the CPU: in-place row compaction, per-layer lengths on
    the device, rows past the batch reset, and a reused storage giving the same cache again."""
    layers, prompts, steps = 4, [5, 9, 4], 40
    kv = KVConfig(policy="rkv", budget=12, buffer=5, window=4, layer_budgets=spread, pyramid_beta=3)
    want = _drive_rows(kv, prompts, steps, 17, [0, 2], layers, None)
    caps = [c + 3 for c in layer_capacities(prompts, steps, kv, layers)]  # a little larger: it fits
    storage = StaticStorage(num_layers=layers, batch=4, num_heads=HEADS, num_kv_heads=KV_HEADS,
                            head_dim=DIM, capacities=caps, window=kv.window, dtype=torch.float32,
                            device=torch.device("cpu"))
    layout = (layers, HEADS, KV_HEADS, DIM, torch.float32)
    assert storage.fits(3, layer_capacities(prompts, steps, kv, layers), kv.window, layout)
    assert not storage.fits(5, caps, kv.window, layout) and not storage.fits(3, caps, None, layout)
    assert not storage.fits(3, [c - REUSE_SLACK - 1 for c in caps], kv.window, layout)
    for _ in range(2):  # a second batch on the reset storage
        storage.reset()
        got = _drive_rows(kv, prompts, steps, 17, [0, 2], layers, storage)
        assert got.lengths == want.lengths and got.deficits == want.deficits
        for layer in range(layers):
            lengths = want.layer_lengths(layer)
            assert storage.lengths[layer].tolist() == lengths + [0, 0]  # rows past the batch start over
            for row, n in enumerate(lengths):
                assert torch.equal(got.k[layer][row, :, :n], want.k[layer][row, :, :n])
                assert torch.equal(got.v[layer][row, :, :n], want.v[layer][row, :, :n])
                assert torch.equal(got.positions[layer, row, :, :n], want.positions[layer, row, :, :n])
                assert got.k[layer].data_ptr() == storage.k[layer].data_ptr()  # views of the storage


def test_layer_lengths_start_on_16_bytes_with_an_odd_batch() -> None:
    """Triton specialises pointers on 16-byte alignment: every layer's row of per-row lengths must
    start on 16 bytes whatever the batch, or an odd batch compiles every kernel reading them twice."""
    layers, prompts = 4, [5, 9, 4]
    kv = KVConfig(policy="rkv", budget=12, buffer=5, window=4)

    def aligned(lengths: torch.Tensor, want: list[list[int]]) -> None:
        assert [lengths[layer].data_ptr() % 16 for layer in range(layers)] == [0] * layers
        assert lengths.tolist() == want

    cache = _drive(kv, prompts, 30, layers=layers)  # prefill, decode steps and compressions
    aligned(cache.lengths_t, [cache.layer_lengths(layer) for layer in range(layers)])
    cache.select_rows([0])
    aligned(cache.lengths_t, [cache.layer_lengths(layer) for layer in range(layers)])
    storage = StaticStorage(num_layers=layers, batch=3, num_heads=HEADS, num_kv_heads=KV_HEADS, head_dim=DIM,
                            capacities=[32] * layers, window=kv.window, dtype=torch.float32,
                            device=torch.device("cpu"))
    storage.advance(3)
    aligned(storage.lengths, [[1, 1, 1]] * layers)
