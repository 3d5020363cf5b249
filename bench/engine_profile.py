"""Where a decode step's time goes: `python -m bench.engine_profile --device cuda --shape 0.6b`.

Random-weight Qwen3 shape (shared.modeling), `--batch` prompts of `--prompt` tokens. One greedy
`generate` of max(`--warm`, `--steps` + 1) tokens is run unprofiled (warm-up, cache allocation and
graph capture, which the later calls reuse), then `--steps` + 1 and 1 tokens under
torch.profiler; their difference over `--steps` gives device time per decode step by
kernel (CUDA; CPU ops on a CPU) and the wall time per step, without the prefill. `--context` pads
the prompts so the steps run at that cache length (attention cost grows with it). Prints a JSON summary;
`--out` also writes it.
"""

from __future__ import annotations

import argparse
import json
import time
from pathlib import Path
from typing import Any

import torch
from torch.profiler import ProfilerActivity, profile

from services.rollout.engine import KVConfig, LLMEngine, SamplingParams
from services.rollout.models.decoder import DecoderLM
from shared.modeling import qwen3_config


def build(shape: str, device: torch.device, dtype: torch.dtype, **engine_options: Any) -> LLMEngine:
    torch.manual_seed(0)
    with torch.device(device):
        model = DecoderLM(qwen3_config(shape)).to(dtype)
    for p in model.parameters():
        torch.nn.init.normal_(p, std=0.02) if p.dim() > 1 else torch.nn.init.ones_(p)
    return LLMEngine(model, device=device, **engine_options)


def _profiled(engine: LLMEngine, prompts: list[list[int]], steps: int, kv: KVConfig) -> tuple[dict, float]:
    """({op: (calls, self device µs or CPU µs)}, wall seconds) of one greedy generate."""
    cuda = engine.device.type == "cuda"
    activities = [ProfilerActivity.CPU] + ([ProfilerActivity.CUDA] if cuda else [])
    if cuda:
        torch.cuda.synchronize()
    start = time.perf_counter()
    with profile(activities=activities) as prof:
        engine.generate(prompts, SamplingParams(temperature=0.0, max_new_tokens=steps), kv)
        if cuda:
            torch.cuda.synchronize()
    wall = time.perf_counter() - start
    if not cuda:
        return {e.key: (e.count, e.self_cpu_time_total) for e in prof.key_averages()}, wall
    # Device time by kernel: an aten op's self device time repeats its kernels' (counted once here);
    # launch API calls are kept for their counts.
    return {e.key: (e.count, 0.0 if e.key.startswith(_LAUNCHES) else e.self_device_time_total)
            for e in prof.key_averages()
            if not e.key.startswith(("aten::", "Command Buffer Full")) and
            (e.self_device_time_total > 0 or e.key.startswith(_LAUNCHES))}, wall


_LAUNCHES = ("cudaLaunchKernel", "cuLaunchKernel", "cudaLaunchKernelExC", "cudaGraphLaunch")


def profile_steps(engine: LLMEngine, prompts: list[list[int]], steps: int, kv: KVConfig,
                  top: int) -> dict[str, Any]:
    """Per decode step: a generate of steps + 1 tokens minus one of 1 token (prefill, set-up)."""
    timed = []
    for n in (steps + 1, 1):  # unprofiled wall time first (the profiler slows the host side)
        if engine.device.type == "cuda":
            torch.cuda.synchronize()
        start = time.perf_counter()
        engine.generate(prompts, SamplingParams(temperature=0.0, max_new_tokens=n), kv)
        if engine.device.type == "cuda":
            torch.cuda.synchronize()
        timed.append(time.perf_counter() - start)
    long, long_wall = _profiled(engine, prompts, steps + 1, kv)
    short, short_wall = _profiled(engine, prompts, 1, kv)
    diff = {k: (c - short.get(k, (0, 0))[0], t - short.get(k, (0, 0))[1]) for k, (c, t) in long.items()}
    total = sum(max(0.0, t) for _, t in diff.values())
    rows = [{"name": k[:90], "calls_per_step": round(c / steps, 1), "us_per_step": round(t / steps, 1),
             "share": round(t / total, 3) if total else None}
            for k, (c, t) in sorted(diff.items(), key=lambda kv_: kv_[1][1], reverse=True)[:top]]
    launches = sum(c for k, (c, _) in diff.items() if k.startswith(_LAUNCHES))
    return {
        "policy": kv.policy,
        "steps": steps,
        "wall_ms_per_step": round(1000 * (timed[0] - timed[1]) / steps, 3),
        "wall_ms_per_step_profiled": round(1000 * (long_wall - short_wall) / steps, 3),
        "device_ms_per_step": round(total / 1000 / steps, 3),
        "launch_calls_per_step": round(launches / steps, 1),
        "top": rows,
    }


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--device", default="cpu")
    parser.add_argument("--shape", default="tiny")
    parser.add_argument("--batch", type=int, default=8)
    parser.add_argument("--prompt", type=int, default=16)
    parser.add_argument(
        "--context", type=int, default=0, help="prompt length to profile at (default --prompt)"
    )
    parser.add_argument("--steps", type=int, default=32)
    parser.add_argument("--warm", type=int, default=16)
    parser.add_argument("--policy", default="dense")
    parser.add_argument("--budget", type=int, default=64)
    parser.add_argument("--buffer", type=int, default=16)
    parser.add_argument("--no-keep-prompt", dest="keep_prompt", action="store_false")
    parser.add_argument("--top", type=int, default=25)
    parser.add_argument("--graphs", choices=["on", "off", "auto"], default="auto")
    parser.add_argument("--out")
    args = parser.parse_args()
    device = torch.device(args.device)
    dtype = torch.bfloat16 if device.type == "cuda" else torch.float32
    options: dict[str, Any] = {} if args.graphs == "auto" else {"cuda_graphs": args.graphs == "on"}
    engine = build(args.shape, device, dtype, **options)
    length = args.context or args.prompt
    prompts = torch.randint(0, engine.config.vocab_size, (args.batch, length),
                            generator=torch.Generator().manual_seed(1)).tolist()
    kv = KVConfig() if args.policy == "dense" else KVConfig(policy=args.policy, budget=args.budget,
                                                            buffer=args.buffer, keep_prompt=args.keep_prompt)
    # Warm-up as long as the longest measured call: it allocates the cache and captures the graphs,
    # which the measured calls then reuse (a 1-token call never reaches a decode step, so a capture
    # in the longer one would not cancel out of their difference).
    warm = SamplingParams(temperature=0.0, max_new_tokens=max(args.warm, args.steps + 1))
    engine.generate(prompts, warm, kv)
    result = {"shape": args.shape, "batch": args.batch, "context": length,
              "device": torch.cuda.get_device_name(device) if device.type == "cuda" else "cpu",
              **profile_steps(engine, prompts, args.steps, kv, args.top)}
    print(json.dumps(result, indent=1))
    if args.out:
        Path(args.out).write_text(json.dumps(result, indent=1) + "\n")


if __name__ == "__main__":
    main()
