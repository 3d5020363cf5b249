"""Sparse-KV engine benchmark: `python -m bench.engine [--device cpu] [--shape tiny] [--gen 256]`.

A Qwen3-shaped model with random weights (shared.modeling.qwen3_config, no download) generates
`--gen` tokens for `--batch` random prompts of `--prompt` tokens, greedily (every sequence runs
to the full length, so all runs do the same work).

0. Overhead proxy: aten ops dispatched per decode step (torch.profiler, CPU side) for `dense` and
   each policy, a device-independent count of what a launch-bound step pays for.
1. Baseline: transformers `generate` (same weights, greedy, same batch) against a `dense` run.
2. Policies: tokens/s, ms per decode step, allocated KV bytes and per-sequence peak KV for `dense`
   and each policy at budgets of `--fractions` (default 25% and 50%) of the generated length
   (keep_prompt; buffer = min(128, gen // 16), so a long run uses Sparse-RL's 128-step
   re-compression).
3. Fixed KV memory (`--skip-fixed` skips it): the dense batch's KV bytes are the memory budget; each policy
   at the smallest fraction's budget runs the largest batch whose cache fits in it, and its tokens/s is
   compared to dense, measured and at the bandwidth limit (`tokens_per_s_vs_dense_at_limit`: the same
   two batches if each step read its bytes at the same rate).

Every row states the bytes a decode step must read (`bytes_per_step`: the weights once, plus each
row's stored K/V, `stored_tokens_read_mean` tokens on average as the engine compresses) and, on CUDA,
the step time at the read bandwidth measured in the run (`limit_ms_per_step`, `x_limit`).

`--layer-budgets pyramid` spreads every sparse budget over the layers as PyramidKV does (same KV
memory; the JSON name gets `-pyramid`); `--dense-from` takes the dense row of an earlier JSON
instead of running dense again; `--skip-same-batch` leaves out section 2. On CUDA, sparse rows
also report `compression_ms` (one compression of a full cache at the row's batch, so its share of
a step is that over the buffer), and `graph_reuse` times two identical short calls (the second
reuses the first's cache and graphs).

Ratios are taken within one run on one device; sections 1 and 3 re-run dense next to their rows
(a shared machine drifts over minutes) unless `--reuse-dense` (a dedicated GPU: saves two dense
runs). The JSON is rewritten after every row, so a run cut off by a time limit keeps what it
measured ("complete": false until the end). It goes to bench/results/engine-<device>.json (CPU
default) or engine-<device>-<shape>-gen<gen>.json for other shapes/lengths. GPU runs (the lead
runs them; each fits ~8 minutes on an H200, see docs/engine.md):
`python -m bench.engine --device cuda --shape 0.6b --gen 4096 --batch 32 --fractions 0.25 --policies rkv
--reuse-dense`
and `--shape 1.7b --gen 8192 --batch 16 --fractions 0.25 --policies rkv --reuse-dense --skip-transformers
--skip-fixed`.
"""

from __future__ import annotations

import argparse
import collections
import json
import platform
import statistics
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

import torch
from torch.profiler import ProfilerActivity, profile
from transformers import Qwen3ForCausalLM

from bench import cuda_ms
from services.rollout.engine import KVConfig, LLMEngine, SamplingParams
from services.rollout.engine.config import layer_budgets
from services.rollout.engine.kv_cache import KVCache, layer_capacities
from services.rollout.models.decoder import DecoderLM
from shared.dtypes import by_short_name, dtype_name
from shared.kv import LAYER_BUDGETS, SPARSE_POLICIES
from shared.modeling import qwen3_config

POLICIES = SPARSE_POLICIES
DTYPES = by_short_name()


def _sync(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)


def _timed(device: torch.device, fn) -> tuple[Any, float, int]:
    """(result, seconds, peak device bytes allocated during fn; 0 on CPU)."""
    if device.type == "cuda":
        torch.cuda.empty_cache()
        torch.cuda.reset_peak_memory_stats(device)
    _sync(device)
    start = time.perf_counter()
    result = fn()
    _sync(device)
    seconds = time.perf_counter() - start
    peak = torch.cuda.max_memory_allocated(device) if device.type == "cuda" else 0
    return result, seconds, peak


def run_engine(engine: LLMEngine, prompts: list[list[int]], gen: int, kv: KVConfig) -> dict[str, Any]:
    params = SamplingParams(temperature=0.0, max_new_tokens=gen)
    # Each row allocates its own cache and captures its graphs inside the timed call (as every call
    # did before graphs were kept): the peak device bytes are then this row's alone.
    engine.release_decode_state()
    outs, seconds, peak_device = _timed(engine.device, lambda: engine.generate(prompts, params, kv))
    tokens = sum(len(o.token_ids) for o in outs)
    return {
        "policy": kv.policy, "budget": kv.budget if kv.policy != "dense" else None,
        "buffer": kv.buffer if kv.policy != "dense" else None, "batch": len(prompts),
        "tokens": tokens, "seconds": round(seconds, 3), "tokens_per_s": round(tokens / seconds, 1),
        "ms_per_step": round(1000 * seconds / gen, 3),
        "kv_bytes_allocated": engine.last_batch_kv_bytes,
        "peak_kv_tokens_per_seq": max(o.kv.peak_tokens for o in outs),
        "peak_kv_bytes_per_seq": max(o.kv.peak_bytes for o in outs),
        "evicted_per_seq": max(o.kv.evicted for o in outs),
        "peak_device_bytes": peak_device,
        "layer_budgets": kv.layer_budgets,
    }


def full_cache(
    engine: LLMEngine, batch: int, prompt: int, gen: int, kv: KVConfig
) -> tuple[KVCache, Callable[[], None]]:
    """A cache of `batch` rows whose layers hold prompt + budget + buffer random keys (the bench's
    random weights find no near-duplicates either), and the call that fills it (again, after a
    compression)."""
    m = engine.model
    capacities = layer_capacities([prompt], gen, kv, m.num_layers)
    cache = KVCache(num_layers=m.num_layers, num_heads=m.num_heads, num_kv_heads=m.num_kv_heads,
                    head_dim=m.head_dim, prompt_lengths=[prompt] * batch, capacity=capacities, kv=kv,
                    dtype=engine.dtype, device=engine.device)
    buffers = (*cache.k, *cache.v) + ((cache.q_window,) if cache.q_window is not None else ())

    def fill() -> None:
        # New keys each time: a compression leaves copies of the moved slots behind, which would
        # be near-duplicates in the next one.
        for buf in buffers:
            buf.normal_()
        cache.set_layer_lengths([[cap] * batch for cap in capacities])

    return cache, fill


def compression_ms(engine: LLMEngine, batch: int, prompt: int, gen: int, kv: KVConfig) -> float:
    """Time of one compression of a full cache (`full_cache`): the median of three after one that
    compiles the Triton kernels. At small batches a compression is bound by the host's launches
    and one timing can be 2-3x the others (115 ms among 37-45 ms at 1.7B batch 16 on an H100).
    Its share of a decode step is this over `kv.buffer` steps."""
    engine.release_decode_state()
    cache, fill = full_cache(engine, batch, prompt, gen, kv)
    times = []
    for _ in range(4):
        fill()
        times.append(_timed(engine.device, cache.compress)[1])
    del cache
    return round(1000 * statistics.median(times[1:]), 3)


def stored_tokens_read(prompt: int, gen: int, kv: KVConfig, layers: int) -> float:
    """Mean stored tokens a decode step reads per row and layer (its new token included) over the
    gen - 1 decode steps of `gen` tokens (the first comes from the prefill), compressing as the
    engine does: after a step, once some layer holds its protected + budget + buffer tokens, every
    layer keeps protected + its budget."""
    if gen < 2:
        return float(prompt)
    if kv.policy == "dense":
        return prompt + gen / 2
    protected = prompt if kv.keep_prompt else 0
    keep = [protected + budget for budget in layer_budgets(kv, layers)]

    def compressed(held: list[int]) -> list[int]:
        if any(n >= k + kv.buffer for n, k in zip(held, keep, strict=True)):
            return [min(n, k) for n, k in zip(held, keep, strict=True)]
        return held

    held = compressed([prompt] * layers)  # the prefill is checked too
    total = 0
    for _ in range(gen - 1):
        total += sum(held) + layers
        held = compressed([n + 1 for n in held])
    return total / ((gen - 1) * layers)


def read_bandwidth(device: torch.device) -> float:
    """Bytes per second the device reads in one large reduction (what a bandwidth-bound step can
    at best stream), from 2 GiB of bf16."""
    x = torch.ones(1 << 30, dtype=torch.bfloat16, device=device)
    with torch.cuda.device(device):
        ms = cuda_ms(lambda: x.sum(dtype=torch.float32), repeats=5)
    return x.numel() * x.element_size() / (ms / 1000)


def with_bandwidth_limit(row: dict[str, Any], weight_bytes: int, kv_bytes_per_token: int, prompt: int,
                         gen: int, kv: KVConfig, layers: int, bandwidth: float | None) -> dict[str, Any]:
    """The row's bytes per decode step (the weights once, each row's stored K/V) and, with a
    measured bandwidth, how far its step is from reading them at that rate."""
    stored = stored_tokens_read(prompt, gen, kv, layers)
    step_bytes = weight_bytes + row["batch"] * stored * kv_bytes_per_token
    row["stored_tokens_read_mean"] = round(stored, 1)
    row["bytes_per_step"] = round(step_bytes)
    if bandwidth:
        row["limit_ms_per_step"] = round(1000 * step_bytes / bandwidth, 3)
        row["x_limit"] = round(row["ms_per_step"] / row["limit_ms_per_step"], 3)
    return row


def ops_per_decode_step(engine: LLMEngine, prompts: list[list[int]], kv: KVConfig) -> dict[str, float]:
    """aten ops dispatched per decode step: the difference of a 12- and a 4-token generate, over 8 steps.

    `all` counts every aten call (views and nested calls included: each costs host time); `ops`
    counts the top-level calls that do work (a proxy for kernel launches on a GPU).
    """
    def count(steps: int) -> collections.Counter[str]:
        engine.release_decode_state()  # both counts allocate and capture, so those ops cancel out
        with profile(activities=[ProfilerActivity.CPU]) as prof:
            engine.generate(prompts, SamplingParams(temperature=0.0, max_new_tokens=steps), kv)
        counts: collections.Counter[str] = collections.Counter()
        for e in prof.events():
            if e.name.startswith("aten::"):
                counts["all"] += 1
                # Ops called by our code, not from inside another aten op (CPU composites such as
                # rms_norm decompose into several, a CUDA kernel does not), that launch work.
                top = e.cpu_parent is None or not e.cpu_parent.name.startswith("aten::")
                counts["ops"] += top and e.name[6:] not in _VIEW_OPS
        return counts

    diff = count(12)
    diff.subtract(count(4))
    return {name: diff[name] / 8 for name in ("all", "ops")}


# aten ops that only make views or read metadata (no kernel launch of their own).
_VIEW_OPS = frozenset(
    """as_strided view transpose reshape slice select narrow unsqueeze squeeze expand t permute
    _unsafe_view resolve_conj resolve_neg result_type empty empty_strided empty_like chunk split unbind
    detach alias
    unflatten flatten lift_fresh _reshape_alias contiguous to type_as scalar_tensor""".split()
)


def run_transformers(
    model: Qwen3ForCausalLM, prompts: list[list[int]], gen: int, device: torch.device
) -> dict:
    ids = torch.tensor(prompts, device=device)

    def generate() -> torch.Tensor:
        with torch.inference_mode():
            return model.generate(
                ids,
                attention_mask=torch.ones_like(ids),
                max_new_tokens=gen,
                min_new_tokens=gen,
                do_sample=False,
                eos_token_id=None,
                pad_token_id=0,
            )

    out, seconds, peak_device = _timed(device, generate)
    tokens = (out.shape[1] - ids.shape[1]) * ids.shape[0]
    return {
        "policy": "transformers.generate",
        "batch": len(prompts),
        "tokens": tokens,
        "seconds": round(seconds, 3),
        "tokens_per_s": round(tokens / seconds, 1),
        "peak_device_bytes": peak_device,
    }


def run(args: argparse.Namespace, save: Any) -> dict[str, Any]:
    """Runs the sections, calling save(result) after every row; returns the finished result."""
    device = torch.device(args.device)
    dtype = DTYPES[args.dtype or ("bf16" if device.type == "cuda" else "fp32")]
    if device.type == "cpu":
        torch.set_num_threads(args.threads)
    torch.manual_seed(0)
    config = qwen3_config(args.shape)
    with torch.device(device):
        model = DecoderLM(config).to(dtype)
    for p in model.parameters():  # random weights with the usual init scale, so logits are not degenerate
        torch.nn.init.normal_(p, std=0.02) if p.dim() > 1 else torch.nn.init.ones_(p)
    engine = LLMEngine(model, device=device)
    gen, batch = args.gen, args.batch
    weight_bytes = sum(p.numel() * p.element_size() for p in model.parameters())  # tied counted once
    bandwidth = read_bandwidth(device) if device.type == "cuda" else None

    def limit(row: dict[str, Any], kv: KVConfig) -> dict[str, Any]:
        return with_bandwidth_limit(row, weight_bytes, engine.kv_bytes_per_token(), args.prompt, gen, kv,
                                    config.num_hidden_layers, bandwidth)
    gen_rng = torch.Generator().manual_seed(1)
    prompts = torch.randint(0, config.vocab_size, (batch, args.prompt), generator=gen_rng).tolist()
    buffer = min(128, max(1, gen // 16))
    policies = args.policies or list(POLICIES)

    def sparse(policy: str, budget: int) -> KVConfig:
        return KVConfig(policy=policy, budget=budget, buffer=buffer, layer_budgets=args.layer_budgets)

    fractions = sorted(args.fractions)
    rows: list[dict[str, Any]] = []
    fixed: list[dict[str, Any]] = []
    result: dict[str, Any] = {
        "benchmark": "engine",
        "complete": False,
        "device": torch.cuda.get_device_name(device)
        if device.type == "cuda"
        else platform.processor() or "cpu",
        "torch": torch.__version__,
        "threads": torch.get_num_threads() if device.type == "cpu" else None,
        "shape": args.shape,
        "dtype": dtype_name(dtype),
        "prompt_tokens": args.prompt,
        "generated_tokens": gen,
        "batch": batch,
        "buffer": buffer,
        "layer_budgets": args.layer_budgets,
        "fractions": fractions,
        "reuse_dense": args.reuse_dense,
        "kv_bytes_per_token": engine.kv_bytes_per_token(),
        "weight_bytes": weight_bytes,
        "read_bandwidth_tb_s": bandwidth and round(bandwidth / 1e12, 3),
        "cuda_graphs": engine.cuda_graphs,
        "ops_per_decode_step": {},
        "policies": rows,
        "fixed_kv_memory": fixed,
        "transformers_generate": None,
    }

    engine.generate(prompts[:2], SamplingParams(temperature=0.0, max_new_tokens=8), KVConfig())  # warm-up
    small = int(gen * fractions[0])
    for policy in ("dense", *policies):
        kv = sparse(policy, max(small, 8)) if policy != "dense" else KVConfig()
        result["ops_per_decode_step"][policy] = ops_per_decode_step(engine, prompts, kv)
    print(json.dumps({"ops_per_decode_step": result["ops_per_decode_step"]}))
    save(result)

    if args.dense_from:
        earlier = json.loads(Path(args.dense_from).read_text())
        same = ("device", "shape", "generated_tokens", "batch", "prompt_tokens")
        if any(earlier[k] != result[k] for k in same):
            raise SystemExit(f"--dense-from {args.dense_from}: another {', '.join(same)}")
        first_dense = dense = dict(next(r for r in earlier["policies"] if r["policy"] == "dense"),
                                   measured_in=Path(args.dense_from).name)
    else:
        first_dense = dense = run_engine(engine, prompts, gen, KVConfig())
    limit(dense, KVConfig())  # an earlier JSON's row too: the bytes follow from its batch
    print(json.dumps(dense))
    rows.append(dense)
    save(result)

    if engine.cuda_graphs:
        # Two identical short calls: the first allocates the cache and captures, the second reuses both.
        engine.release_decode_state()
        short = SamplingParams(temperature=0.0, max_new_tokens=64)
        reuse: dict[str, Any] = {"max_new_tokens": 64}
        for call in ("first", "second"):
            before = engine.graph_captures
            _, seconds, _ = _timed(device, lambda: engine.generate(prompts, short, KVConfig()))
            reuse[call] = {"seconds": round(seconds, 4), "captures": engine.graph_captures - before}
        result["graph_reuse"] = reuse
        print(json.dumps({"graph_reuse": reuse}))
        save(result)

    def dense_again() -> dict[str, Any]:
        # On a shared machine speed drifts over minutes: ratios use a dense run made next to them.
        if args.reuse_dense:
            return first_dense
        again = limit(run_engine(engine, prompts, gen, KVConfig()), KVConfig())
        print(json.dumps(again))
        return again

    # Sections run in the order of the targets, so a run cut off by a time limit keeps the first ones.
    baseline = None
    if not args.skip_transformers:
        with torch.device(device):  # build in place: a 1.7B fp32 init on the CPU takes long
            hf = Qwen3ForCausalLM(config).to(dtype).eval()
        hf.load_state_dict(engine.state_dict(), strict=False)
        hf.tie_weights()
        run_transformers(hf, prompts[:2], 8, device)  # warm-up
        baseline = run_transformers(hf, prompts, gen, device)
        del hf
        dense = dense_again()
        baseline["dense_tokens_per_s"] = dense["tokens_per_s"]
        baseline["dense_tokens_per_s_vs_transformers"] = round(
            dense["tokens_per_s"] / baseline["tokens_per_s"], 3
        )
        print(json.dumps(baseline))
        result["transformers_generate"] = baseline
        save(result)

    if device.type == "cuda":
        # Compile each budget's compression kernels (Triton, on a fresh machine seconds each) before
        # any timed row: a full cache of two rows at the row's span compiles what the runs call.
        for fraction in fractions:
            for policy in policies:
                compression_ms(engine, 2, args.prompt, gen, sparse(policy, int(gen * fraction)))

    for fraction in fractions if not args.skip_same_batch else ():  # against the latest dense run
        for policy in policies:
            kv = sparse(policy, int(gen * fraction))
            row = limit(run_engine(engine, prompts, gen, kv), kv)
            if device.type == "cuda":
                row["compression_ms"] = compression_ms(engine, batch, args.prompt, gen, kv)
            row["budget_fraction"] = fraction
            row["kv_vs_dense"] = round(row["kv_bytes_allocated"] / dense["kv_bytes_allocated"], 3)
            row["tokens_per_s_vs_dense"] = round(row["tokens_per_s"] / dense["tokens_per_s"], 3)
            print(json.dumps(row))
            rows.append(row)
            save(result)

    # Fixed KV memory: the dense batch's cache bytes, filled with as many sparse sequences as fit.
    dense = dense_again() if not args.skip_fixed else first_dense
    memory = dense["kv_bytes_allocated"]
    for policy in policies if not args.skip_fixed else ():
        kv = sparse(policy, small)
        layers = engine.model.num_layers
        slots = sum(layer_capacities([args.prompt], gen, kv, layers))
        per_seq = slots * engine.kv_bytes_per_token() // layers
        big = max(1, memory // per_seq)
        big_prompts = torch.randint(0, config.vocab_size, (big, args.prompt), generator=gen_rng).tolist()
        row = limit(run_engine(engine, big_prompts, gen, kv), kv)
        row["kv_memory_budget"] = memory
        row["dense_batch"], row["dense_tokens_per_s"] = dense["batch"], dense["tokens_per_s"]
        row["tokens_per_s_vs_dense"] = round(row["tokens_per_s"] / dense["tokens_per_s"], 3)
        # What the same two runs would give if both read their bytes at the same rate: the most the
        # cache's smaller reads can buy against a dense engine at the bandwidth limit.
        row["tokens_per_s_vs_dense_at_limit"] = round(
            big / row["bytes_per_step"] / (dense["batch"] / dense["bytes_per_step"]), 3)
        if device.type == "cuda":
            row["compression_ms"] = compression_ms(engine, big, args.prompt, gen, kv)
        print(json.dumps(row))
        fixed.append(row)
        save(result)

    smallest = [r for r in rows if r.get("budget_fraction") == fractions[0]]
    result["complete"] = True
    result["summary"] = {
        "smallest_budget_fraction": fractions[0],
        "worst_kv_vs_dense_at_smallest_budget": max(
            (r["kv_vs_dense"] for r in smallest), default=None
        ),
        "best_tokens_per_s_vs_dense_at_equal_kv_memory": max(
            (r["tokens_per_s_vs_dense"] for r in fixed), default=None
        ),
        "best_tokens_per_s_vs_dense_at_equal_kv_memory_at_limit": max(
            (r["tokens_per_s_vs_dense_at_limit"] for r in fixed), default=None
        ),
        "dense_vs_transformers_generate": baseline and baseline["dense_tokens_per_s_vs_transformers"],
    }
    return result


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--device", default="cpu")
    parser.add_argument("--shape", default="tiny", help="shared.modeling shape: tiny, small, 0.6b, 1.7b")
    parser.add_argument("--gen", type=int, default=256, help="generated tokens per sequence")
    parser.add_argument("--prompt", type=int, default=16, help="prompt tokens per sequence")
    parser.add_argument("--batch", type=int, default=8)
    parser.add_argument("--dtype", choices=sorted(DTYPES), help="default bf16 on cuda, fp32 on cpu")
    parser.add_argument("--threads", type=int, default=1, help="CPU threads (1 is steadiest on a shared box)")
    parser.add_argument("--policies", nargs="*", choices=POLICIES)
    parser.add_argument("--fractions", nargs="+", default=["0.25", "0.5"],
                        help="budgets as fractions of --gen (the smallest also sets the fixed-memory budget)")
    parser.add_argument("--reuse-dense", action="store_true",
                        help="compare sections 2 and 3 with the first dense run instead of re-running dense")
    parser.add_argument("--skip-transformers", action="store_true")
    parser.add_argument("--skip-fixed", action="store_true", help="skip the fixed-KV-memory section")
    parser.add_argument("--skip-same-batch", action="store_true",
                        help="skip the policies at the dense batch (section 2); fixed memory only")
    parser.add_argument("--dense-from", help="compare with the dense row of this earlier run's JSON (same "
                        "device, shape, --gen, --batch, --prompt) instead of running dense again")
    parser.add_argument("--layer-budgets", choices=LAYER_BUDGETS, default="uniform",
                        help="how sparse budgets are spread over layers (pyramid: PyramidKV)")
    parser.add_argument("--out", help="JSON path (default bench/results/engine-<device>[...].json)")
    args = parser.parse_args()
    device = torch.device(args.device).type
    default_name = f"engine-{device}" if (args.shape, args.gen) == ("tiny", 256) else (
        f"engine-{device}-{args.shape}-gen{args.gen}")
    if args.layer_budgets != "uniform":
        default_name += f"-{args.layer_budgets}"
    out = Path(args.out or f"bench/results/{default_name}.json")
    try:  # `--fractions 0.25 0.5` or `--fractions "0.25 0.5"`
        args.fractions = [float(f) for arg in args.fractions for f in arg.replace(",", " ").split()]
    except ValueError as exc:
        parser.error(f"--fractions: {exc}")
    if not args.fractions or any(not 0 < f <= 1 for f in args.fractions):
        parser.error("--fractions must lie in (0, 1]")
    out.parent.mkdir(parents=True, exist_ok=True)

    def save(result: dict[str, Any]) -> None:
        # Write-then-rename: a run killed mid-write still leaves the previous complete file.
        tmp = out.with_suffix(".json.tmp")
        tmp.write_text(json.dumps(result, indent=2) + "\n")
        tmp.replace(out)

    result = run(args, save)
    save(result)
    print(json.dumps(result["summary"]), "->", out)


if __name__ == "__main__":
    main()
