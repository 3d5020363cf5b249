"""A decode step's sampling, torch ops against the CUDA kernels: `python -m bench.sampler` (CUDA).

Per batch (32 and 112 rows: the 0.6B equal-memory benches' dense and R-KV batches) and vocabulary
(Qwen3's 151,936), bf16 logits: `sampler.sample_torch` (an fp32 copy, log-softmax, exp, cumsum,
searchsorted) against `sampler.sample` (kernels.greedy, kernels.sample), greedy and at T = 1.
The bound is one read of the bf16 logits per pass the kernel makes (1 greedy, 3 sampling).
JSON: bench/results/sampler-<device>.json.
"""

from __future__ import annotations

import argparse
import json
from pathlib import Path

import torch

from bench import cuda_ms
from services.rollout.engine import SamplingParams
from services.rollout.engine.sampler import sample, sample_torch

RESULTS = Path(__file__).resolve().parent / "results"
VOCAB = 151_936


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--out")
    args = parser.parse_args()
    device = torch.cuda.get_device_name()
    rows = []
    for batch in (32, 112):
        logits = torch.randn(batch, VOCAB, device="cuda").to(torch.bfloat16)
        uniforms = torch.rand(batch, device="cuda")
        for temperature, passes in ((0.0, 1), (1.0, 3)):
            params = SamplingParams(temperature=temperature, max_new_tokens=1)
            args_ = (logits, params, uniforms)
            torch_us = 1000 * cuda_ms(lambda args_=args_: sample_torch(*args_), repeats=200, warmup=10)
            kernel_us = 1000 * cuda_ms(lambda args_=args_: sample(*args_), repeats=200, warmup=10)
            read = passes * logits.numel() * logits.element_size()
            rows.append({"batch": batch, "temperature": temperature, "torch_us": round(torch_us, 1),
                         "kernel_us": round(kernel_us, 1), "speedup": round(torch_us / kernel_us, 2),
                         "kernel_reads_bytes": read, "kernel_tb_per_s": round(read / kernel_us / 1e6, 2)})
            print(rows[-1], flush=True)
    card = "h100" if "H100" in device else "cuda"
    out = Path(args.out) if args.out else RESULTS / f"sampler-{card}.json"
    result = {"bench": "sampler", "device": device, "vocab": VOCAB, "rows": rows}
    out.write_text(json.dumps(result, indent=1) + "\n")


if __name__ == "__main__":
    main()
