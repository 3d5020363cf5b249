"""Sparse-KV engine benchmark: `python -m bench.engine [--device cpu] [--shape tiny] [--gen 256]`.

A Qwen3-shaped model with random weights (shared.modeling.qwen3_config, no download) generates
`--gen` tokens for `--batch` random prompts of `--prompt` tokens, greedily (every sequence runs
to the full length, so all runs do the same work).

1. Policies: tokens/s, allocated KV bytes and per-sequence peak KV for `dense` and each policy at
   budgets of 25% and 50% of the generated length (keep_prompt; buffer = min(128, gen // 16), so
   a long run uses Sparse-RL's 128-step re-compression).
2. Fixed KV memory: the dense batch's KV bytes are the memory budget; each policy at the 25%
   budget runs the largest batch whose cache fits in it, and its tokens/s is compared to dense.
3. Baseline: transformers `generate` (same weights, greedy, same batch) against a `dense` run made
   right after it.

Ratios are taken within one run on one device. JSON goes to bench/results/engine-<device>.json
(CPU default) or engine-<device>-<shape>-gen<gen>.json for other shapes/lengths. GPU runs (the lead
runs them): `python -m bench.engine --device cuda --shape 0.6b --gen 4096 --batch 32`
(then 1.7b, and --gen 8192 with a smaller --batch); `--policies rkv` to shorten a run.
"""

from __future__ import annotations

import argparse
import json
import platform
import time
from pathlib import Path
from typing import Any

import torch
from transformers import Qwen3ForCausalLM

from services.rollout.engine import KVConfig, LLMEngine, SamplingParams
from services.rollout.engine.kv_cache import cache_capacity
from services.rollout.models.decoder import DecoderLM
from shared.modeling import qwen3_config

POLICIES = ("streaming", "snapkv", "h2o", "rkv")
DTYPES = {"bf16": torch.bfloat16, "fp16": torch.float16, "fp32": torch.float32}


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
    outs, seconds, peak_device = _timed(engine.device, lambda: engine.generate(prompts, params, kv))
    tokens = sum(len(o.token_ids) for o in outs)
    return {
        "policy": kv.policy, "budget": kv.budget if kv.policy != "dense" else None,
        "buffer": kv.buffer if kv.policy != "dense" else None, "batch": len(prompts),
        "tokens": tokens, "seconds": round(seconds, 3), "tokens_per_s": round(tokens / seconds, 1),
        "kv_bytes_allocated": engine.last_batch_kv_bytes,
        "peak_kv_tokens_per_seq": max(o.kv.peak_tokens for o in outs),
        "peak_kv_bytes_per_seq": max(o.kv.peak_bytes for o in outs),
        "evicted_per_seq": max(o.kv.evicted for o in outs),
        "peak_device_bytes": peak_device,
    }


def run_transformers(model: Qwen3ForCausalLM, prompts: list[list[int]], gen: int, device: torch.device) -> dict:
    ids = torch.tensor(prompts, device=device)

    def generate() -> torch.Tensor:
        with torch.inference_mode():
            return model.generate(ids, attention_mask=torch.ones_like(ids), max_new_tokens=gen, min_new_tokens=gen,
                                  do_sample=False, eos_token_id=None, pad_token_id=0)

    out, seconds, peak_device = _timed(device, generate)
    tokens = (out.shape[1] - ids.shape[1]) * ids.shape[0]
    return {"policy": "transformers.generate", "batch": len(prompts), "tokens": tokens,
            "seconds": round(seconds, 3), "tokens_per_s": round(tokens / seconds, 1), "peak_device_bytes": peak_device}


def run(args: argparse.Namespace) -> dict[str, Any]:
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
    gen_rng = torch.Generator().manual_seed(1)
    prompts = torch.randint(0, config.vocab_size, (batch, args.prompt), generator=gen_rng).tolist()
    buffer = min(128, max(1, gen // 16))
    policies = args.policies or list(POLICIES)

    engine.generate(prompts[:2], SamplingParams(temperature=0.0, max_new_tokens=8), KVConfig())  # warm-up
    dense = run_engine(engine, prompts, gen, KVConfig())
    print(json.dumps(dense))
    rows = [dense]
    for fraction in (0.25, 0.5):
        for policy in policies:
            row = run_engine(engine, prompts, gen, KVConfig(policy=policy, budget=int(gen * fraction), buffer=buffer))
            row["budget_fraction"] = fraction
            row["kv_vs_dense"] = round(row["kv_bytes_allocated"] / dense["kv_bytes_allocated"], 3)
            row["tokens_per_s_vs_dense"] = round(row["tokens_per_s"] / dense["tokens_per_s"], 3)
            print(json.dumps(row))
            rows.append(row)

    # Fixed KV memory: the dense batch's cache bytes, filled with as many sparse sequences as fit.
    # Ratios use a dense run made next to them (a shared machine's speed drifts over minutes).
    dense = run_engine(engine, prompts, gen, KVConfig())
    print(json.dumps(dense))
    memory = dense["kv_bytes_allocated"]
    fixed = []
    for policy in policies:
        kv = KVConfig(policy=policy, budget=gen // 4, buffer=buffer)
        per_seq = cache_capacity([args.prompt], gen, kv) * engine.kv_bytes_per_token()
        big = max(1, memory // per_seq)
        big_prompts = torch.randint(0, config.vocab_size, (big, args.prompt), generator=gen_rng).tolist()
        row = run_engine(engine, big_prompts, gen, kv)
        row["kv_memory_budget"] = memory
        row["dense_batch"], row["dense_tokens_per_s"] = dense["batch"], dense["tokens_per_s"]
        row["tokens_per_s_vs_dense"] = round(row["tokens_per_s"] / dense["tokens_per_s"], 3)
        print(json.dumps(row))
        fixed.append(row)

    baseline = None
    if not args.skip_transformers:
        with torch.device(device):  # build in place: a 1.7B fp32 init on the CPU takes long
            hf = Qwen3ForCausalLM(config).to(dtype).eval()
        hf.load_state_dict(engine.state_dict(), strict=False)
        hf.tie_weights()
        run_transformers(hf, prompts[:2], 8, device)  # warm-up
        baseline = run_transformers(hf, prompts, gen, device)
        dense = run_engine(engine, prompts, gen, KVConfig())
        baseline["dense_tokens_per_s"] = dense["tokens_per_s"]
        baseline["dense_tokens_per_s_vs_transformers"] = round(dense["tokens_per_s"] / baseline["tokens_per_s"], 3)
        print(json.dumps(baseline))
        del hf

    quarter = [r for r in rows if r.get("budget_fraction") == 0.25]
    return {
        "benchmark": "engine",
        "device": torch.cuda.get_device_name(device) if device.type == "cuda" else platform.processor() or "cpu",
        "torch": torch.__version__, "threads": torch.get_num_threads() if device.type == "cpu" else None,
        "shape": args.shape, "dtype": str(dtype).removeprefix("torch."), "prompt_tokens": args.prompt,
        "generated_tokens": gen, "batch": batch, "buffer": buffer,
        "kv_bytes_per_token": engine.kv_bytes_per_token(),
        "policies": rows, "fixed_kv_memory": fixed, "transformers_generate": baseline,
        "summary": {
            "worst_kv_vs_dense_at_25pct_budget": max(r["kv_vs_dense"] for r in quarter),
            "best_tokens_per_s_vs_dense_at_equal_kv_memory": max(r["tokens_per_s_vs_dense"] for r in fixed),
            "dense_vs_transformers_generate": baseline and baseline["dense_tokens_per_s_vs_transformers"],
        },
    }


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
    parser.add_argument("--skip-transformers", action="store_true")
    parser.add_argument("--out", help="JSON path (default bench/results/engine-<device>[...].json)")
    args = parser.parse_args()
    device = torch.device(args.device).type
    default_name = f"engine-{device}" if (args.shape, args.gen) == ("tiny", 256) else (
        f"engine-{device}-{args.shape}-gen{args.gen}")
    out = Path(args.out or f"bench/results/{default_name}.json")
    result = run(args)
    out.parent.mkdir(parents=True, exist_ok=True)
    out.write_text(json.dumps(result, indent=2) + "\n")
    print(json.dumps(result["summary"]), "->", out)


if __name__ == "__main__":
    main()
