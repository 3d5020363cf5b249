"""Where one KV compression's time goes: `python -m bench.compression_profile --shape 0.6b --batch 112`.

A full cache (every layer at prompt + budget + buffer random keys, as `bench.engine`'s
`compression_ms` builds it) is compressed three times unprofiled (Triton compiles, allocator warms),
then once under torch.profiler. Reports the wall time of a compression and its device time by op
(CUDA) or CPU time (CPU). JSON: bench/results/compression-profile-<device>-<shape>-b<batch>.json.
"""

from __future__ import annotations

import argparse
import json
import time
from pathlib import Path

import torch
from torch.profiler import ProfilerActivity, profile

from bench.engine import full_cache
from bench.engine_profile import build
from services.rollout.engine import KVConfig

RESULTS = Path(__file__).resolve().parent / "results"


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    parser.add_argument("--shape", default="0.6b")
    parser.add_argument("--batch", type=int, default=112)
    parser.add_argument("--gen", type=int, default=4096)
    parser.add_argument("--policy", default="rkv")
    parser.add_argument("--prompt", type=int, default=16)
    parser.add_argument("--top", type=int, default=15)
    parser.add_argument("--out")
    args = parser.parse_args()
    device = torch.device(args.device)
    cuda = device.type == "cuda"
    engine = build(args.shape, device, torch.bfloat16 if cuda else torch.float32)
    kv = KVConfig(policy=args.policy, budget=args.gen // 4, buffer=128)
    cache, refill = full_cache(engine, args.batch, args.prompt, args.gen, kv)

    def sync() -> None:
        if cuda:
            torch.cuda.synchronize()

    def fill() -> None:
        refill()
        sync()

    walls = []
    for _ in range(3):
        fill()
        start = time.perf_counter()
        cache.compress()
        sync()
        walls.append(time.perf_counter() - start)
    fill()
    activities = [ProfilerActivity.CPU] + ([ProfilerActivity.CUDA] if cuda else [])
    with profile(activities=activities) as prof:
        cache.compress()
        sync()
    events = list(prof.key_averages())
    if cuda:  # kernels and copies only: an aten op's row repeats its kernels' time
        events = [e for e in events if str(e.device_type).endswith("CUDA")]
    key = "self_device_time_total" if cuda else "self_cpu_time_total"
    total = sum(getattr(e, key) for e in events)
    top = sorted(events, key=lambda e: getattr(e, key), reverse=True)[: args.top]
    result = {
        "bench": "compression-profile",
        "device": torch.cuda.get_device_name(device) if cuda else "cpu",
        "shape": args.shape, "batch": args.batch, "policy": args.policy,
        "stored_tokens_per_layer": cache.k[0].shape[2], "layers": engine.model.num_layers,
        "wall_ms": round(1000 * walls[-1], 2),
        "profiled_total_ms": round(total / 1000, 2),
        "top_ops": [{"name": e.key[:80], "calls": e.count, "ms": round(getattr(e, key) / 1000, 2),
                     "share": round(getattr(e, key) / total, 3)} for e in top],
    }
    print(json.dumps(result, indent=1))
    name = f"compression-profile-{'h100' if 'H100' in result['device'] else args.device}"
    out = Path(args.out) if args.out else RESULTS / f"{name}-{args.shape}-b{args.batch}.json"
    out.write_text(json.dumps(result, indent=1) + "\n")


if __name__ == "__main__":
    main()
