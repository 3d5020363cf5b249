"""vLLM engine benchmark: `python -m bench.vllm_engine [--device cpu] [--shape tiny] [--batch 64]`.

A Qwen3-shaped model with random weights (shared.modeling.qwen3_config, saved to a temp dir in
bf16, no download) generates `--gen` tokens greedily for `--batch` random prompts of `--prompt`
tokens (no stop ids, so every run does the same work), through:

1. the native engine (`dense` KV) and the vLLM engine: generated tokens/s, and vLLM / native;
2. weight updates into the running vLLM: `weights_updated` of every tensor (a full reload) and of
   one layer's q_proj + gate_proj (sent as q/k/v + gate/up), median of `--reloads` runs;
3. vLLM startup (`from_pretrained` until ready).

Ratios are taken within one run on one device. JSON goes to bench/results/vllm_engine-<device>.json
(default shape/batch) or vllm_engine-<device>-<shape>-b<batch>.json otherwise. GPU (the lead runs it,
with the CUDA vllm wheel): `python -m bench.vllm_engine --device cuda --shape 0.6b --batch 64 --gen 1024`.
vLLM runs with multiprocessing unless `--in-process` (VLLM_ENABLE_V1_MULTIPROCESSING=0).
"""

from __future__ import annotations

import argparse
import gc
import json
import os
import platform
import statistics
import tempfile
import time
from pathlib import Path
from typing import Any

import torch

from services.rollout.engine import KVConfig, LLMEngine, SamplingParams
from shared.dtypes import by_short_name
from shared.modeling import qwen3_config

DTYPES = by_short_name()
RESULTS = Path(__file__).parent / "results"


def _sync(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)


def timed_generate(
    engine: Any, prompts: list[list[int]], gen: int, device: torch.device, repeats: int
) -> dict[str, Any]:
    """Best of `repeats` greedy batches (after a warm-up batch): tokens, seconds, tokens/s."""
    params = SamplingParams(temperature=0.0, max_new_tokens=gen)
    engine.generate(prompts[:2], SamplingParams(temperature=0.0, max_new_tokens=8), KVConfig())
    best = float("inf")
    tokens = 0
    for _ in range(repeats):
        _sync(device)
        start = time.perf_counter()
        outs = engine.generate(prompts, params, KVConfig())
        _sync(device)
        best = min(best, time.perf_counter() - start)
        tokens = sum(len(o.token_ids) for o in outs)
    return {
        "batch": len(prompts),
        "tokens": tokens,
        "seconds": round(best, 3),
        "tokens_per_s": round(tokens / best, 1),
    }


def timed_reload(engine: Any, names: set[str], runs: int) -> float:
    """Median milliseconds of weights_updated(names), values perturbed in place before each run."""
    state = engine.state_dict()
    times = []
    for _ in range(runs):
        for name in names:  # flip one element's sign so every reload carries a real change
            state[name].view(-1)[0].neg_()
        start = time.perf_counter()
        engine.weights_updated(names)
        times.append(time.perf_counter() - start)
    return round(1000 * statistics.median(times), 2)


def run(args: argparse.Namespace) -> dict[str, Any]:
    device, dtype = torch.device(args.device), DTYPES[args.dtype]
    if device.type == "cpu":
        torch.set_num_threads(args.threads)
        os.environ.setdefault("VLLM_CPU_KVCACHE_SPACE", str(args.kv_gib))
    os.environ["VLLM_ENABLE_V1_MULTIPROCESSING"] = "0" if args.in_process else "1"
    from transformers import Qwen3ForCausalLM

    from services.rollout.vllm.engine import VLLMEngine

    config = qwen3_config(args.shape)
    prompts = torch.randint(0, config.vocab_size, (args.batch, args.prompt),
                            generator=torch.Generator().manual_seed(1)).tolist()
    result: dict[str, Any] = {
        "bench": "vllm_engine",
        "device": args.device,
        "device_name": torch.cuda.get_device_name(device)
        if device.type == "cuda"
        else platform.processor() or platform.machine(),
        "shape": args.shape,
        "dtype": args.dtype,
        "prompt": args.prompt,
        "gen": args.gen,
        "enforce_eager": args.eager,
        "multiprocessing": not args.in_process,
        "threads": args.threads if device.type == "cpu" else None,
        # Other work on the machine skews CPU numbers (and their ratio, measured minutes apart).
        "load_avg_1m_start": round(os.getloadavg()[0], 2),
    }
    with tempfile.TemporaryDirectory() as model_dir:
        torch.manual_seed(0)
        Qwen3ForCausalLM(config).to(dtype).save_pretrained(model_dir)

        if not args.no_native:  # first, so vLLM's GPU memory reservation does not starve it
            native = LLMEngine.from_pretrained(model_dir, device=device, dtype=dtype)
            result["native"] = timed_generate(native, prompts, args.gen, device, args.repeats)
            print("native", json.dumps(result["native"]))
            del native
            gc.collect()
            if device.type == "cuda":
                torch.cuda.empty_cache()

        options: dict[str, Any] = {
            "enforce_eager": args.eager,
            "max_model_len": args.prompt + args.gen + 8,
            "seed": 0,
        }
        if device.type == "cuda":
            options["gpu_memory_utilization"] = args.gpu_memory_utilization
        start = time.perf_counter()
        engine = VLLMEngine.from_pretrained(model_dir, device=device, dtype=dtype, **options)
        result["vllm_startup_s"] = round(time.perf_counter() - start, 2)
        result["vllm"] = timed_generate(engine, prompts, args.gen, device, args.repeats)
        print("vllm", json.dumps(result["vllm"]))
        if "native" in result:
            result["vllm_vs_native_tokens_per_s"] = round(
                result["vllm"]["tokens_per_s"] / result["native"]["tokens_per_s"], 2
            )

        state = engine.state_dict()
        one_layer = {"model.layers.0.self_attn.q_proj.weight", "model.layers.0.mlp.gate_proj.weight"}
        result["reload"] = {
            "all_tensors": len(state),
            "all_bytes": sum(t.nbytes for t in state.values()),
            "all_ms": timed_reload(engine, set(state), args.reloads),
            "one_layer_ms": timed_reload(engine, one_layer, args.reloads),
        }
        print("reload", json.dumps(result["reload"]))
    result["load_avg_1m_end"] = round(os.getloadavg()[0], 2)
    return result


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--device", default="cpu")
    parser.add_argument("--shape", default="tiny", choices=["tiny", "small", "0.6b", "1.7b"])
    parser.add_argument("--dtype", default="bf16", choices=list(DTYPES))
    parser.add_argument("--batch", type=int, default=64)
    parser.add_argument("--prompt", type=int, default=32)
    parser.add_argument("--gen", type=int, default=128)
    parser.add_argument("--repeats", type=int, default=2, help="timed batches per engine (best is kept)")
    parser.add_argument("--reloads", type=int, default=5)
    parser.add_argument("--threads", type=int, default=2, help="CPU: torch threads of the native engine")
    parser.add_argument("--kv-gib", type=int, default=2, help="CPU: VLLM_CPU_KVCACHE_SPACE when unset")
    parser.add_argument("--gpu-memory-utilization", type=float, default=0.8)
    parser.add_argument("--eager", action=argparse.BooleanOptionalAction, default=None,
                        help="vLLM enforce_eager (default: on for CPU, off for CUDA)")
    parser.add_argument("--in-process", action="store_true", help="VLLM_ENABLE_V1_MULTIPROCESSING=0")
    parser.add_argument("--no-native", action="store_true")
    args = parser.parse_args()
    if args.eager is None:
        args.eager = torch.device(args.device).type == "cpu"
    result = run(args)
    RESULTS.mkdir(parents=True, exist_ok=True)
    device = torch.device(args.device).type
    default = args.shape == "tiny" and args.batch == 64
    name = (
        f"vllm_engine-{device}.json" if default else f"vllm_engine-{device}-{args.shape}-b{args.batch}.json"
    )
    (RESULTS / name).write_text(json.dumps(result, indent=2) + "\n")
    print(f"wrote bench/results/{name}")


if __name__ == "__main__":  # vLLM spawns its engine process: the guard keeps the child from re-running this
    main()
