"""The trainer's learner on one or several GPUs: GRPO steps on rollouts from the native engine,
a patch per step applied to the engine's weights (a worker's copy).

    torchrun --nproc_per_node 2 -m bench.distributed --shape 4b      # FSDP2, shards per GPU
    python -m bench.distributed --shape 1.7b                          # one process, the whole model

A Qwen3-shaped model with random weights (saved once in bf16, so the engine and the learner
start from the same weights); rewards are random (a random model solves nothing; the update's
cost does not depend on them). Per step: rollout (rank 0's GPU, R-KV cache), `train_step`
(ppo_updates AdamW steps), capture (each rank compares its shard of the bf16 weights) and the
patch assembled on rank 0, applied to the engine with its fingerprints checked. On rank 0 the
single-process extractor also runs on the same full weights (the engine's copy before and after),
so the sharded path's cost is compared on the same bytes, and its patch must be identical.
With --registry, the worker's side is the services' own: a registry subprocess (loopback, file://
store in a temporary folder, no Redis: the worker asks for plans over HTTP), v0 published as a
snapshot, each step's patch published with the trainer's client (shared.registry.publish) and the
engine brought to it by the rollout worker's sync (services.rollout.sync.WeightSync over
shared.registry.sync.sync_weights: plan, download, verify, apply under the engine lock); the
fingerprint the worker reaches must equal the learner's.
Reported: step time, trained tokens/s, peak memory per GPU, extraction seconds per step and per
GB of bf16 model, split into the capture's phases (encode on each rank, the all-to-all, zstd on
the owning ranks, the gather to rank 0) and the container's layout on rank 0.
JSON: bench/results/distributed-<shape>-<world>x<card>.json.
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import json
import random
import statistics
import tempfile
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import torch

from services.rollout.engine import KVConfig, LLMEngine, SamplingParams
from services.trainer.distributed import make_learner
from services.trainer.learner import LearnerConfig
from services.trainer.optim import OptimSettings
from services.trainer.settings import TrainerSettings
from shared.modeling import qwen3_config
from shared.patch import apply_patch, extract_patch, fingerprint, read_header, save_snapshot
from shared.ports import free_port
from shared.schemas import KVStats, Sample, SamplingInfo, Trajectory

RESULTS = Path(__file__).resolve().parent / "results"


def make_model_dir(shape: str, path: Path, device: torch.device) -> None:
    """A random-weight Qwen3 of `shape` saved in bf16 with the char tokenizer (rank 0, once)."""
    from transformers import AutoModelForCausalLM

    from shared.tokenizer import save_tokenizer

    if (path / "config.json").is_file():
        return
    config = qwen3_config(shape)
    tokenizer = save_tokenizer(path)
    config.bos_token_id, config.eos_token_id, config.pad_token_id = (
        tokenizer.bos_token_id,
        tokenizer.eos_token_id,
        tokenizer.pad_token_id,
    )
    torch.manual_seed(0)
    with torch.device(device):  # random init on the GPU: minutes faster than on a CPU for billions
        model = AutoModelForCausalLM.from_config(config, dtype=torch.bfloat16)
    model.save_pretrained(path)
    del model


def rollout(
    engine: LLMEngine, args: argparse.Namespace, step: int, vocab: int
) -> tuple[list[Trajectory], int]:
    rng = random.Random(step)
    prompts = [
        [1] + [rng.randrange(4, vocab) for _ in range(args.prompt_tokens - 1)] for _ in range(args.groups)
    ]
    params = SamplingParams(temperature=1.0, max_new_tokens=args.new_tokens, seed=step)
    kv = KVConfig(policy="rkv", budget=args.kv_budget, buffer=args.kv_buffer)
    outputs = engine.generate([p for p in prompts for _ in range(args.samples)], params, kv)
    trajectories, tokens = [], 0
    for g, prompt in enumerate(prompts):
        samples = []
        for out in outputs[g * args.samples : (g + 1) * args.samples]:
            tokens += len(prompt) + len(out.token_ids)
            samples.append(
                Sample(
                    completion="",
                    prompt_ids=prompt,
                    completion_ids=out.token_ids,
                    logprobs=out.logprobs,
                    reward=rng.random(),
                    correct=False,
                    finish_reason=out.finish_reason,
                    kv=KVStats(
                        peak_tokens=out.kv.peak_tokens, peak_bytes=out.kv.peak_bytes, evicted=out.kv.evicted
                    ),
                )
            )
        trajectories.append(
            Trajectory(
                group_id=f"s{step}-{g}",
                attempt=1,
                policy_version=step,
                worker_id="bench",
                task="addition",
                prompt="",
                samples=samples,
                sampling=SamplingInfo(temperature=1.0, kv_policy="rkv", kv_budget=args.kv_budget),
            )
        )
    return trajectories, tokens


class RegistryWorker:
    """The registry (a subprocess) and a native worker's weight sync onto `engine`, driven from
    this synchronous bench through one event loop."""

    def __init__(self, url: str, engine: LLMEngine, model_dir: Path) -> None:
        from transformers import AutoTokenizer

        from services.rollout.core import RolloutCore
        from services.rollout.settings import RolloutSettings
        from services.rollout.sync import WeightSync
        from shared.registry.client import RegistryClient

        from .registry import TOKEN

        self.loop = asyncio.new_event_loop()
        self.client = RegistryClient(url, "bench", token=TOKEN)
        settings = RolloutSettings(
            model=str(model_dir), registry_url=url, data_dir=str(model_dir / "rollout")
        )
        self.core = RolloutCore(settings, engine, AutoTokenizer.from_pretrained(model_dir), model_dir)
        self.sync = WeightSync(self.core, self.client)

    def publish_v0(self, state: dict[str, torch.Tensor]) -> float:
        t0 = time.perf_counter()
        data = save_snapshot({k: v.cpu() for k, v in state.items()}, run="bench", version=0)
        self.loop.run_until_complete(self.client.publish_snapshot(0, data))
        return time.perf_counter() - t0

    def publish(self, version: int, patch: bytes) -> float:
        t0 = time.perf_counter()
        self.loop.run_until_complete(self.client.publish_patch(version, patch))
        return time.perf_counter() - t0

    def sync_to(self, version: int) -> tuple[float, int, str]:
        """(seconds, version reached, its fingerprint as the worker records it)."""
        t0 = time.perf_counter()
        reached = self.loop.run_until_complete(self.sync.sync_to(version))
        return time.perf_counter() - t0, reached, self.core.weights.fingerprint

    def close(self) -> None:
        self.loop.run_until_complete(self.client.aclose())
        self.loop.close()


@contextlib.contextmanager
def registry_worker(enabled: bool, engine: LLMEngine, model_dir: Path) -> Iterator[RegistryWorker | None]:
    if not enabled:
        yield None
        return
    from .registry import registry_process

    with tempfile.TemporaryDirectory(prefix="sparsecast-registry-") as store:
        with registry_process(free_port(), Path(store)) as url:
            worker = RegistryWorker(url, engine, model_dir)
            try:
                yield worker
            finally:
                worker.close()


def run_steps(
    args: argparse.Namespace,
    learner: Any,
    engine: LLMEngine,
    live: dict[str, torch.Tensor],
    device: torch.device,
    worker: RegistryWorker | None,
    out: Path,
) -> list[dict[str, Any]]:
    """The steps on rank 0: rollout, train, capture, patch, then the worker's weights brought to
    it (through the registry, or by applying the patch), and the single-process extractor on the
    same weights for comparison. The steps so far are written to `out` after each (a run cut
    short by a time limit still leaves them)."""
    vocab = 256  # prompt tokens from the char tokenizer's range; the model may sample any of its vocabulary
    rows: list[dict[str, Any]] = []
    for step in range(args.steps):
        t_roll = time.perf_counter()
        trajectories, tokens = rollout(engine, args, step, vocab)
        rollout_seconds = time.perf_counter() - t_roll
        _sync(device)
        t_train = time.perf_counter()
        metrics = learner.train_step(trajectories, version=step)
        _sync(device)
        train_seconds = time.perf_counter() - t_train
        t_cap = time.perf_counter()
        captured = learner.capture()
        capture_seconds = time.perf_counter() - t_cap
        t_build = time.perf_counter()
        patch = captured.make_patch("bench", step, step + 1)
        build_seconds = time.perf_counter() - t_build
        # The single-process extractor on the same full weights: the engine's copy before and after.
        before = {name: t.clone() for name, t in live.items()}
        sync: dict[str, Any] = {}
        if worker is not None:
            sync["publish_seconds"] = worker.publish(step + 1, patch)
            seconds, reached, worker_fp = worker.sync_to(step + 1)
            sync |= {"sync_seconds": seconds, "sync_path": worker.core.weights.last_sync["path"],
                     "worker_version": reached}
            _sync(device)
        else:
            t_apply = time.perf_counter()
            apply_patch(live, patch)  # checks the base and target fingerprints
            _sync(device)
            sync["apply_seconds"] = time.perf_counter() - t_apply
            reached, worker_fp = step + 1, read_header(patch).target_fingerprint
        t_single = time.perf_counter()
        single = extract_patch(before, live, run="bench", base_version=step, target_version=step + 1)
        single_seconds = time.perf_counter() - t_single
        del before
        header = read_header(patch)
        row = {
            "step": step + 1,
            "loss": metrics["loss"],
            "grad_norm": metrics["grad_norm"],
            "sequences": metrics["sequences"],
            "tokens": tokens,
            "rollout_seconds": rollout_seconds,
            "train_seconds": train_seconds,
            "tokens_per_second": tokens / train_seconds,
            "capture_seconds": capture_seconds,
            "capture_phases": captured.timings,  # sharded only: encode, exchange, entropy, gather
            "build_seconds": build_seconds,
            "extract_seconds": capture_seconds + build_seconds,
            "single_process_extract_seconds": single_seconds,
            **sync,
            "patch_bytes": len(patch),
            "changed": header.changed,
            "changed_fraction": header.changed / learner.numel,
            "patch_identical_to_single_process": patch == single,
            "worker_fingerprint_equal": reached == step + 1
            and fingerprint(live) == worker_fp == captured.fingerprint == header.target_fingerprint,
        }
        rows.append(row)
        print(json.dumps(row), flush=True)
        out.write_text(json.dumps({"partial": True, "shape": args.shape, "steps": rows}, indent=1) + "\n")
    return rows


def peak_gib() -> float:
    return torch.cuda.max_memory_allocated() / 2**30 if torch.cuda.is_available() else 0.0


def main() -> None:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("--shape", default="4b")
    parser.add_argument("--steps", type=int, default=4)
    parser.add_argument("--groups", type=int, default=8)
    parser.add_argument("--samples", type=int, default=8)
    parser.add_argument("--prompt-tokens", type=int, default=32)
    parser.add_argument("--new-tokens", type=int, default=256)
    parser.add_argument("--kv-budget", type=int, default=128)
    parser.add_argument("--kv-buffer", type=int, default=32)
    parser.add_argument("--micro-batch", type=int, default=8)
    parser.add_argument("--lr", type=float, default=1e-6)
    parser.add_argument("--activation-checkpointing", action="store_true")
    parser.add_argument("--device", default="auto")
    parser.add_argument("--model-dir", default="")
    parser.add_argument("--card", default="", help="the GPU model, for the file name (e.g. h100)")
    parser.add_argument("--out", default="")
    parser.add_argument("--registry", action="store_true",
                        help="publish each patch to a registry subprocess; the worker syncs from it")
    args = parser.parse_args()

    from services.trainer.distributed import control_group, init_process_groups, launched_distributed

    distributed = launched_distributed()
    rank, world = init_process_groups(args.device) if distributed else (0, 1)
    settings = TrainerSettings(
        model="unused",
        device=args.device,
        optim=OptimSettings(lr=args.lr),
        micro_batch=args.micro_batch,
        ppo_updates=4,
        activation_checkpointing=args.activation_checkpointing,
    )
    device = (
        torch.device(f"cuda:{torch.cuda.current_device()}")
        if torch.cuda.is_available() and args.device != "cpu"
        else torch.device("cpu")
    )
    model_dir = Path(args.model_dir or Path(tempfile.gettempdir()) / f"sparsecast-bench-{args.shape}")
    if rank == 0:
        make_model_dir(args.shape, model_dir, device)
    if distributed:
        torch.distributed.barrier(group=control_group())

    t0 = time.perf_counter()
    learner = make_learner(LearnerConfig.of(settings), model_dir, pad_id=0)
    load_seconds = time.perf_counter() - t0
    if rank != 0:
        learner.follow()  # type: ignore[attr-defined]
        report = {"rank": rank, "peak_gib": peak_gib()}
        torch.distributed.gather_object(report, None, dst=0, group=control_group())
        return

    engine = LLMEngine.from_pretrained(model_dir, device=device, dtype=torch.bfloat16)
    live = engine.state_dict()
    assert fingerprint(live) == learner.published_fingerprint, "engine and learner start from other weights"
    card = (args.card or "cpu").lower()
    out = Path(args.out) if args.out else RESULTS / f"distributed-{args.shape}-{world}x{card}.json"
    out.parent.mkdir(parents=True, exist_ok=True)
    with registry_worker(args.registry, engine, model_dir) as worker:
        publish_v0_seconds = worker.publish_v0(live) if worker is not None else None
        print(json.dumps({"load_seconds": load_seconds, "publish_v0_seconds": publish_v0_seconds}),
              flush=True)
        rows = run_steps(args, learner, engine, live, device, worker, out)
    if distributed:
        learner.stop_followers()  # type: ignore[attr-defined]
        others = [None] * world
        torch.distributed.gather_object(
            {"rank": 0, "peak_gib": peak_gib()}, others, dst=0, group=control_group()
        )
        peaks = [r["peak_gib"] for r in others]  # type: ignore[index]
    else:
        peaks = [peak_gib()]
    timed = rows[1:] or rows  # the first step includes warm-up (allocator, kernels)
    gb = learner.dense_bytes / 1e9
    extract = statistics.median(r["extract_seconds"] for r in timed)
    single = statistics.median(r["single_process_extract_seconds"] for r in timed)
    phases: dict[str, float] = {  # the sharded capture's phases; the worker's publish and sync
        f"capture_{phase}_seconds": statistics.median(r["capture_phases"][phase] for r in timed)
        for phase in timed[0]["capture_phases"]
    }
    phases |= {
        key: statistics.median(r[key] for r in timed)
        for key in ("publish_seconds", "sync_seconds", "apply_seconds")
        if key in timed[0]
    }
    result = {
        "shape": args.shape,
        "world_size": world,
        "numel": learner.numel,
        "dense_bytes": learner.dense_bytes,
        "card": args.card or (torch.cuda.get_device_name() if torch.cuda.is_available() else "cpu"),
        "settings": {k: v for k, v in vars(args).items() if k not in ("out", "model_dir")},
        "load_seconds": load_seconds,
        "median": {
            "train_seconds": statistics.median(r["train_seconds"] for r in timed),
            "tokens_per_second": statistics.median(r["tokens_per_second"] for r in timed),
            "extract_seconds": extract,
            "extract_seconds_per_gb": extract / gb,
            "single_process_extract_seconds": single,
            "single_process_extract_seconds_per_gb": single / gb,
            "rollout_seconds": statistics.median(r["rollout_seconds"] for r in timed),
            "build_seconds": statistics.median(r["build_seconds"] for r in timed),
            **phases,
        },
        "registry": args.registry,
        "publish_v0_seconds": publish_v0_seconds,
        "peak_gib_per_gpu": peaks,
        "peak_gib_note": "rank 0 also holds the engine (bf16 weights + KV) and two full bf16 copies for the "
        "single-process comparison",
        "all_patches_identical": all(r["patch_identical_to_single_process"] for r in rows),
        "all_fingerprints_equal": all(r["worker_fingerprint_equal"] for r in rows),
        "steps": rows,
    }
    out.write_text(json.dumps(result, indent=1) + "\n")
    print(json.dumps({k: v for k, v in result.items() if k != "steps"}, indent=1))
    if distributed:
        torch.distributed.destroy_process_group()


def _sync(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)


if __name__ == "__main__":
    main()
