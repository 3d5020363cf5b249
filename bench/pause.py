"""Generation pause per weight version: `python -m bench.pause [--shape 1.7b] [--device cuda]`.

A Qwen3-shaped model (from config, no download) is trained with AdamW (lr 1e-6) for --versions
steps as in bench.patch, each step's bf16 weights published as a patch (`auto` encoding). Then
the rollout worker's own pieces serve the base weights: a RolloutCore over the project's engine
generates batch after batch (what the worker loop does), and every patch is applied through the
worker's sync path (shared.registry.sync.apply_patches into services.rollout.sync.EngineWeights:
staged, i.e. verified and decoded, while generation goes on, then written under the engine lock)
while it generates. Per version it records the pause (how long the engine lock was held for the
swap: generation stopped), the staging time (base fingerprint, decode, predicted target
fingerprint; off the lock), the write + read-back time inside the pause, the changed elements,
and the physical limit of the write: the bytes of the changed values and their (4-byte) indices
over the device's measured read bandwidth. The JSON (bench/results/pause-<device>[-shape].json)
has the pause distribution (median, p99, max) and the card (torch.cuda.get_device_name), and
(unless --no-baseline) the same versions applied again from the base the way the sync did before
staging, apply_patch whole under the engine lock, as a same-run baseline.
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import json
import math
import platform
import statistics
import tempfile
import time
from collections.abc import AsyncIterator
from pathlib import Path
from typing import Any, cast

import numpy as np
import torch
from transformers import PreTrainedTokenizerBase, Qwen3ForCausalLM

from bench.engine import read_bandwidth
from bench.patch import _BATCH, text_like_tokens
from services.rollout.core import RolloutCore
from services.rollout.engine import LLMEngine, SamplingParams
from services.rollout.models.decoder import DecoderLM
from services.rollout.settings import RolloutSettings
from services.rollout.sync import EngineWeights
from shared.modeling import qwen3_config
from shared.patch import apply_patch, extract_patch, fingerprint, read_header
from shared.registry.sync import apply_patches

StateDict = dict[str, torch.Tensor]
TARGET_MEDIAN_S, TARGET_P99_S = 0.005, 0.020  # issue 29, for the 1.7B shape on an H100


def make_patches(shape: str, versions: int, device: torch.device, lr: float, seed: int,
                 batch: int | None = None, seq: int | None = None,
                 ) -> tuple[StateDict, list[bytes], list[int]]:
    """The base bf16 weights (on the host), one `auto` patch per AdamW step, and each step's
    changed-element count: the trainer side of bench.patch, without its measurements."""
    torch.manual_seed(seed)
    rng = np.random.default_rng(seed)
    config = qwen3_config(shape)
    batch, seq = batch or _BATCH[shape][0], seq or _BATCH[shape][1]
    with torch.device(device):  # initialised where it trains (a CPU init of 1.7B takes long)
        model = Qwen3ForCausalLM(config)  # fp32 master weights
    optimizer = torch.optim.AdamW(model.parameters(), lr=lr, betas=(0.9, 0.98), weight_decay=0.1)
    autocast = (torch.autocast("cuda", dtype=torch.bfloat16) if device.type == "cuda"
                else torch.autocast("cpu", enabled=False))

    def published() -> StateDict:  # named_parameters: tied embeddings appear once
        return {name: p.detach().to(torch.bfloat16) for name, p in model.named_parameters()}

    old = published()
    base = {k: v.cpu() for k, v in old.items()}
    old_fp = fingerprint(old)
    patches, changed = [], []
    for step in range(versions):
        tokens = text_like_tokens(config.vocab_size, batch * seq, rng).view(batch, seq).to(device)
        with autocast:
            loss = model(input_ids=tokens, labels=tokens).loss
        loss.backward()
        optimizer.step()
        optimizer.zero_grad(set_to_none=True)
        new = published()
        new_fp = fingerprint(new)
        patch = extract_patch(old, new, run="pause", base_version=step, target_version=step + 1,
                              base_fingerprint=old_fp, target_fingerprint=new_fp)
        patches.append(patch)
        changed.append(sum(t.count for t in read_header(patch).tensors))
        print(f"patch {step + 1}: {changed[-1]} changed, {len(patch) / 1e6:.1f} MB", flush=True)
        old, old_fp = new, new_fp
    return base, patches, changed


class TimedWeights(EngineWeights):
    """The worker's weight target, with timestamps of each step of a version's swap."""

    def __init__(self, core: RolloutCore) -> None:
        super().__init__(core)
        self.marks: dict[str, float] = {}

    def phase(self, phase: str) -> None:
        self.marks[phase] = time.perf_counter()  # "decoding": staging starts; "applying": lock held
        super().phase(phase)

    @contextlib.asynccontextmanager
    async def _timed_writing(self) -> AsyncIterator[object]:
        self.marks["staged"] = time.perf_counter()  # asks for the lock once the patch is staged
        async with super().writing() as held:
            yield held

    def writing(self) -> contextlib.AbstractAsyncContextManager[object]:
        return self._timed_writing()

    def updated(self, names: set[str]) -> None:
        self.marks["written"] = time.perf_counter()  # commit_patch returned
        super().updated(names)


def build_core(shape: str, device: torch.device, base: StateDict, model_dir: Path) -> RolloutCore:
    """A RolloutCore (the worker's) over the project's engine, holding the base weights."""
    config = qwen3_config(shape)
    config.save_pretrained(model_dir)
    dtype = torch.bfloat16 if device.type == "cuda" else torch.float32
    with torch.device(device):
        model = DecoderLM(config).to(torch.bfloat16)
    engine = LLMEngine(model, device=device, compute_dtype=dtype)
    state = engine.state_dict()
    if set(state) != set(base):
        differ = sorted(set(state) ^ set(base))[:4]
        raise RuntimeError(f"engine and trainer name the weights differently: {differ}")
    with torch.no_grad():
        for name, tensor in base.items():
            state[name].copy_(tensor)
    engine.weights_updated(set(state))
    settings = RolloutSettings(model=str(model_dir), device=device.type)
    tokenizer = cast(PreTrainedTokenizerBase, None)  # the bench generates from token ids
    return RolloutCore(settings, engine, tokenizer, model_dir, version=0)


async def whole_under_lock(core: RolloutCore, patch: bytes) -> None:
    """The baseline: how the sync applied a patch before it was staged, apply_patch (verify,
    decode, write, fingerprint) with the engine lock held throughout."""
    async with core.weights_swap():
        header = await asyncio.to_thread(apply_patch, core.engine.state_dict(), patch, verify=True)
        core.engine.weights_updated({t.name for t in header.tensors})
        core.weights.version, core.weights.fingerprint = header.target_version, header.target_fingerprint


async def serve_and_sync(core: RolloutCore, patches: list[bytes], prompts: list[list[int]],
                         params: SamplingParams, gap_batches: int,
                         staged: bool = True) -> tuple[list[dict[str, float]], int]:
    """Generate continuously (as the worker loop does) and apply each patch through the sync path
    while it does (staged: False, the baseline whole_under_lock instead); returns per-version
    timings and the batches generated meanwhile."""
    stop = asyncio.Event()
    batches = 0
    progress = asyncio.Condition()

    async def generate() -> None:
        nonlocal batches
        while not stop.is_set():
            await core.generate(prompts, params)
            async with progress:
                batches += 1
                progress.notify_all()

    async def batches_pass(n: int) -> None:
        async with progress:
            start = batches
            await progress.wait_for(lambda: batches >= start + n)

    generation = asyncio.create_task(generate())
    rows = []
    try:
        await batches_pass(2)  # warm: CUDA graphs captured, caches allocated
        for version, patch in enumerate(patches):
            swaps = core.swaps
            if not staged:
                await whole_under_lock(core, patch)
                (pause,) = core.pauses_since(swaps)
                rows.append({"version": version + 1, "pause_s": pause})
                print(f"baseline v{version + 1}: pause {pause * 1e3:.2f} ms", flush=True)
                await batches_pass(gap_batches)
                continue
            target = TimedWeights(core)
            reached = await apply_patches(target, [memoryview(patch)], version)
            if reached != version + 1 or core.weights.version != version + 1:
                raise RuntimeError(f"sync reached {reached}, expected {version + 1}")
            (pause,) = core.pauses_since(swaps)
            m = target.marks
            rows.append({"version": version + 1, "pause_s": pause, "stage_s": m["staged"] - m["decoding"],
                         "lock_wait_s": m["applying"] - m["staged"], "write_s": m["written"] - m["applying"]})
            print(f"v{version + 1}: pause {pause * 1e3:.2f} ms (write {rows[-1]['write_s'] * 1e3:.2f} ms), "
                  f"staged in {rows[-1]['stage_s']:.3f} s while generating", flush=True)
            await batches_pass(gap_batches)
    finally:
        stop.set()
        await generation
    return rows, batches


def cpu_read_bandwidth() -> float:
    """Bytes per second one large reduction reads on this CPU (best of 3, 256 MiB of fp32)."""
    x = torch.ones(1 << 26)
    best = math.inf
    for _ in range(3):
        t0 = time.perf_counter()
        x.sum()
        best = min(best, time.perf_counter() - t0)
    return x.numel() * x.element_size() / best


def percentile(values: list[float], q: float) -> float:
    ordered = sorted(values)
    return ordered[min(len(ordered) - 1, max(0, math.ceil(q * len(ordered)) - 1))]


def run(args: argparse.Namespace) -> dict[str, Any]:
    device = torch.device(args.device)
    if device.type == "cpu":
        torch.set_num_threads(args.threads)
    base, patches, changed = make_patches(args.shape, args.versions, device, args.lr, args.seed,
                                          args.train_batch, args.train_seq)
    if device.type == "cuda":
        torch.cuda.empty_cache()  # the trainer's model and optimizer are gone
    bandwidth = read_bandwidth(device) if device.type == "cuda" else cpu_read_bandwidth()
    with tempfile.TemporaryDirectory() as tmp:
        core = build_core(args.shape, device, base, Path(tmp))
        if fingerprint(core.engine.state_dict()) != read_header(patches[0]).base_fingerprint:
            raise RuntimeError("the engine does not hold the patches' base weights")
        vocab = qwen3_config(args.shape).vocab_size
        g = torch.Generator().manual_seed(args.seed)
        prompts = torch.randint(0, vocab, (args.batch, args.prompt), generator=g).tolist()
        params = SamplingParams(temperature=1.0, max_new_tokens=args.gen)
        t0 = time.perf_counter()
        rows, batches = asyncio.run(serve_and_sync(core, patches, prompts, params, args.gap_batches))
        wall = time.perf_counter() - t0
        exact = fingerprint(core.engine.state_dict()) == read_header(patches[-1]).target_fingerprint
        baseline: list[dict[str, float]] = []
        if args.baseline:  # the same versions again from the base, the whole apply under the lock
            core = build_core(args.shape, device, base, Path(tmp))
            baseline, _ = asyncio.run(serve_and_sync(core, patches, prompts, params, args.gap_batches,
                                                     staged=False))
        del base
    value_bytes = 2  # bf16
    for row, count, patch in zip(rows, changed, patches, strict=True):
        row["changed"] = count
        row["patch_bytes"] = len(patch)
        row["physical_bytes"] = count * (value_bytes + 4)  # new values + int32 indices
        row["physical_limit_s"] = row["physical_bytes"] / bandwidth
    pauses = [r["pause_s"] for r in rows]
    summary: dict[str, Any] = {
        "versions": len(rows),
        "median_pause_s": statistics.median(pauses),
        "p99_pause_s": percentile(pauses, 0.99),
        "max_pause_s": max(pauses),
        "min_pause_s": min(pauses),
        "median_write_s": statistics.median(r["write_s"] for r in rows),
        "median_stage_s": statistics.median(r["stage_s"] for r in rows),
        "median_changed": statistics.median(changed),
        "median_physical_limit_s": statistics.median(r["physical_limit_s"] for r in rows),
        "batches_generated": batches,
        "final_weights_match_last_target_fingerprint": exact,
    }
    if baseline:
        base_pauses = [r["pause_s"] for r in baseline]
        summary["baseline_whole_apply_under_lock"] = {
            "median_pause_s": statistics.median(base_pauses), "p99_pause_s": percentile(base_pauses, 0.99),
            "max_pause_s": max(base_pauses)}
    return {
        "bench": "pause",
        "device": device.type,
        "device_name": (torch.cuda.get_device_name(device) if device.type == "cuda"
                        else f"{platform.processor() or platform.machine()} "
                             f"({torch.get_num_threads()} threads)"),
        "shape": args.shape,
        "lr": args.lr,
        "generation": {"batch": args.batch, "prompt": args.prompt, "max_new_tokens": args.gen,
                       "kv": core.kv_config().policy, "engine": core.engine.name},
        "read_bandwidth_bytes_per_s": bandwidth,
        "torch": torch.__version__,
        "wall_s": wall,
        "per_version": rows,
        "baseline_per_version": baseline,
        "summary": summary,
        "targets_are_for": "the 1.7b shape on an H100 (issue 29)",
        "targets": {"median_pause_le_5ms": summary["median_pause_s"] <= TARGET_MEDIAN_S,
                    "p99_pause_le_20ms": summary["p99_pause_s"] <= TARGET_P99_S},
    }


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--device", default="cpu")
    parser.add_argument("--shape", default="tiny", help="shared.modeling shape: tiny, small, 0.6b, 1.7b")
    parser.add_argument("--versions", type=int, default=10, help="patches applied while generating")
    parser.add_argument("--lr", type=float, default=1e-6)
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--train-batch", type=int, help="training batch (default as bench.patch)")
    parser.add_argument("--train-seq", type=int, help="training sequence length (default as bench.patch)")
    parser.add_argument("--batch", type=int, default=8, help="sequences per generation batch")
    parser.add_argument("--prompt", type=int, default=32, help="prompt tokens per sequence")
    parser.add_argument("--gen", type=int, default=64, help="new tokens per sequence")
    parser.add_argument("--gap-batches", type=int, default=1, help="batches generated between versions")
    parser.add_argument("--threads", type=int, default=1, help="CPU threads")
    parser.add_argument("--no-baseline", dest="baseline", action="store_false",
                        help="skip the baseline: the same versions applied whole under the engine lock")
    parser.add_argument("--out", help="JSON path (default bench/results/pause-<device>[-<shape>].json)")
    args = parser.parse_args()
    device = torch.device(args.device).type
    shape = "" if args.shape == "tiny" else f"-{args.shape}"
    out = Path(args.out or f"bench/results/pause-{device}{shape}.json")
    out.parent.mkdir(parents=True, exist_ok=True)
    result = run(args)
    out.write_text(json.dumps(result, indent=2) + "\n")
    print(json.dumps(result["summary"]), json.dumps(result["targets"]), "->", out)


if __name__ == "__main__":
    main()
