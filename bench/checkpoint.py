"""What the trainer's checkpoint costs: `python -m bench.checkpoint --device cuda --shape qwen3-1.7b`.

The real `Learner` (fp32 master weights on the device, AdamW) is built from a random-weight
Qwen3 of the shape (shared.modeling.qwen3_config, saved once in bf16, no download) and takes
one AdamW step, so Adam's moments exist. Then, `--reps` times, the trainer's own checkpoint path
(`Trainer.save_checkpoint`, replicated step for step: `Learner.save` into a `.tmp` folder, i.e. a
DCP save of `get_state_dict(model, optimizer)` plus `learner.pt`; `state_checksum()`;
`trainer.pt`; `fsync_tree`; rename; `fsync_dir`), each phase timed; then the live state is
perturbed (every weight and Adam state + 1), the page cache of the checkpoint dropped, and
`Learner.load` + `state_checksum()` timed, the checksum compared with the saved one.

The physical limits, measured in the same run on the same file system: sequential write
bandwidth (one large file, written then fsync'd) and cold read bandwidth, and the device-to-host
copy of the whole state into pinned and into pageable host memory. The asynchronous alternative
(copy into pinned host memory, write from it in a background thread, publish once durable) is
measured as its two halves: the copy (what the step would wait for) and the DCP save + fsync of
the host copy (what the background thread would take).

JSON: bench/results/checkpoint-<card>.json (or --out-dir), rewritten after every phase
(`complete` is false until the run ends).
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import re
import shutil
import statistics
import time
import warnings
from collections.abc import Callable
from pathlib import Path
from typing import Any

import numpy as np
import torch
import torch.distributed.checkpoint as dcp
from torch.distributed.checkpoint.state_dict import get_state_dict
from transformers import AutoModelForCausalLM

from services.trainer.learner import Learner, LearnerConfig
from services.trainer.ledger import fsync_dir, fsync_tree
from services.trainer.settings import TrainerSettings
from shared.modeling import qwen3_config

RESULTS = Path(__file__).resolve().parent / "results"
GB = 1e9
_CHUNK = 64 << 20  # bytes per write() of the disk test


def shape_name(shape: str) -> str:
    """"qwen3-1.7b" → "1.7b" (shared.modeling's names)."""
    return shape.removeprefix("qwen3-")


def card_name(device: torch.device) -> str:
    if device.type != "cuda":
        return "cpu"
    found = re.search(r"[A-Z]\d{2,3}", torch.cuda.get_device_name(device))
    return found.group(0).lower() if found else "cuda"


def make_model_dir(shape: str, path: Path, device: torch.device) -> None:
    """A random-weight Qwen3 of `shape` saved in bf16, as bench.distributed's (without the tokenizer:
    the learner needs none)."""
    if (path / "config.json").is_file():
        return
    torch.manual_seed(0)
    with torch.device(device):  # random init on the GPU: minutes faster than on a CPU for billions
        model = AutoModelForCausalLM.from_config(qwen3_config(shape), dtype=torch.bfloat16)
    model.save_pretrained(path)


def _sync(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)


def timed(device: torch.device, fn: Callable[[], Any]) -> tuple[Any, float]:
    _sync(device)
    t0 = time.perf_counter()
    out = fn()
    _sync(device)
    return out, time.perf_counter() - t0


def tree_bytes(root: Path) -> tuple[int, int]:
    files = [p for p in root.rglob("*") if p.is_file()]
    return sum(p.stat().st_size for p in files), len(files)


DROP_CACHES = False  # --drop-caches: the whole host's page cache (a machine of one's own only)


def drop_cache(root: Path) -> str:
    """Evict `root`'s (clean, fsync'd) pages from the page cache, so a read comes from the disk:
    posix_fadvise(DONTNEED) per file, or with --drop-caches the kernel's drop_caches (root)."""
    os.sync()
    if DROP_CACHES:
        try:
            Path("/proc/sys/vm/drop_caches").write_text("3\n")
            return "drop_caches"
        except OSError:
            pass
    paths = [root] if root.is_file() else [p for p in root.rglob("*") if p.is_file()]
    for path in paths:
        fd = os.open(path, os.O_RDONLY)
        try:
            os.posix_fadvise(fd, 0, 0, os.POSIX_FADV_DONTNEED)
        finally:
            os.close(fd)
    return "fadvise"


def file_system(path: Path) -> dict[str, Any]:
    """The mount holding `path` (longest mount point that prefixes it) and its free space."""
    real = str(path.resolve())
    best = ("", "", "")
    with open("/proc/mounts") as f:
        for line in f:
            dev, mnt, fstype = line.split()[:3]
            if (real == mnt or real.startswith(mnt.rstrip("/") + "/")) and len(mnt) >= len(best[1]):
                best = (dev, mnt, fstype)
    usage = shutil.disk_usage(path)
    return {"device": best[0], "mount": best[1], "fstype": best[2],
            "free_gb": usage.free / GB, "total_gb": usage.total / GB}


def disk_bandwidth(root: Path, size: int) -> dict[str, Any]:
    """Sequential write of `size` bytes (64 MiB writes of random bytes, then fsync) and, with the
    file's pages dropped, its sequential read: the limits a checkpoint's bytes face."""
    path = root / "disk-test.bin"
    block = np.random.default_rng(0).integers(0, 256, _CHUNK, dtype=np.uint8).tobytes()
    t0 = time.perf_counter()
    with open(path, "wb", buffering=0) as f:
        written = 0
        while written < size:
            written += f.write(block[: min(_CHUNK, size - written)])
        t_written = time.perf_counter()
        os.fsync(f.fileno())
    write_s = time.perf_counter() - t0
    fsync_s = time.perf_counter() - t_written
    evicted = drop_cache(path)
    t0 = time.perf_counter()
    with open(path, "rb", buffering=0) as f:
        while f.read(_CHUNK):
            pass
    read_s = time.perf_counter() - t0
    path.unlink()
    return {"bytes": size, "write_seconds": write_s, "write_fsync_part_seconds": fsync_s,
            "write_gb_per_s": size / write_s / GB, "read_cold_seconds": read_s,
            "read_cold_gb_per_s": size / read_s / GB, "cache_evicted_by": evicted}


def state_tensors(learner: Learner) -> list[torch.Tensor]:
    """Every tensor of the state a checkpoint holds: master weights (tied ones once) and every
    optimizer state tensor."""
    out = list(learner.model.parameters())
    for state in learner.optimizer.state.values():
        out += [v for _, v in sorted(state.items()) if isinstance(v, torch.Tensor)]
    return out


def nbytes(tensors: list[torch.Tensor]) -> int:
    return sum(t.numel() * t.element_size() for t in tensors)


def adam_step(learner: Learner, vocab: int, batch: int, seq: int) -> float:
    """One AdamW step on a language-model loss over random tokens (the moments then exist)."""
    device = learner.device
    tokens = torch.randint(0, vocab, (batch, seq), generator=torch.Generator().manual_seed(0)).to(device)
    learner.model.train()
    learner.optimizer.zero_grad(set_to_none=True)
    with learner._autocast():
        loss = learner.model(input_ids=tokens, labels=tokens).loss
    loss.backward()
    learner._optimizer_step(1.0)
    learner.optimizer.zero_grad(set_to_none=True)  # the trainer's grads are freed by the next step
    learner.step += 1
    return float(loss.detach())


def save_like_trainer(learner: Learner, root: Path, version: int) -> tuple[Path, str, dict[str, float]]:
    """`Trainer.save_checkpoint`, step for step, each phase timed (trainer.pt without the history
    and the KV controller, a few hundred bytes there)."""
    device = learner.device
    final = root / f"v{version:08d}"
    tmp = final.with_name(final.name + ".tmp")
    shutil.rmtree(tmp, ignore_errors=True)
    tmp.mkdir(parents=True)
    _, save_s = timed(device, lambda: learner.save(tmp))
    checksum, checksum_s = timed(device, learner.state_checksum)
    t0 = time.perf_counter()
    torch.save({"version": version, "fingerprint": learner.published_fingerprint, "state_checksum": checksum,
                "history": [], "rng": torch.get_rng_state(), "numpy_rng": np.random.get_state(),
                "kv_control": {}}, tmp / "trainer.pt")
    trainer_pt_s = time.perf_counter() - t0
    t0 = time.perf_counter()
    fsync_tree(tmp)
    fsync_s = time.perf_counter() - t0
    t0 = time.perf_counter()
    shutil.rmtree(final, ignore_errors=True)
    os.rename(tmp, final)
    fsync_dir(root)
    rename_s = time.perf_counter() - t0
    return final, checksum, {"save_seconds": save_s, "checksum_seconds": checksum_s,
                             "trainer_pt_seconds": trainer_pt_s, "fsync_seconds": fsync_s,
                             "rename_seconds": rename_s,
                             "total_seconds": save_s + checksum_s + trainer_pt_s + fsync_s + rename_s}


def perturb(learner: Learner) -> None:
    """Every weight and optimizer state + 1, and other counters: a load must restore them all."""
    with torch.no_grad():
        for t in state_tensors(learner):
            t.add_(1)
    learner.step += 7
    learner.shuffle.manual_seed(12345)


def pinned_like(state: Any, memo: dict[int, torch.Tensor]) -> Any:
    """The state dict's structure with every tensor replaced by a pinned host buffer (shared storage
    shared once, as a tied embedding is)."""
    if isinstance(state, torch.Tensor):
        key = state.data_ptr()
        if key not in memo:
            memo[key] = torch.empty(state.shape, dtype=state.dtype, pin_memory=torch.cuda.is_available())
        return memo[key]
    if isinstance(state, dict):
        return {k: pinned_like(v, memo) for k, v in state.items()}
    if isinstance(state, list | tuple):
        return type(state)(pinned_like(v, memo) for v in state)
    return state


def copy_into(dst: Any, src: Any) -> None:
    if isinstance(src, torch.Tensor):
        if dst.data_ptr() != src.data_ptr():
            dst.copy_(src, non_blocking=True)
    elif isinstance(src, dict):
        for k, v in src.items():
            copy_into(dst[k], v)
    elif isinstance(src, list | tuple):
        for d, s in zip(dst, src, strict=True):
            copy_into(d, s)


def async_alternative(learner: Learner, root: Path, reps: int) -> dict[str, Any]:
    """The asynchronous save's halves: the copy of the state into pinned host buffers (the only part
    the step would wait for; buffers allocated once), the pageable copy as a comparison, and the
    background thread's work (DCP save of the host copy + fsync), timed here in the foreground."""
    device = learner.device
    model, optim = get_state_dict(learner.model, learner.optimizer)
    state = {"model": model, "optim": optim}
    memo: dict[int, torch.Tensor] = {}
    host, alloc_s = timed(device, lambda: pinned_like(state, memo))
    copied = sum(t.numel() * t.element_size() for t in memo.values())
    copies = [timed(device, lambda: copy_into(host, state))[1] for _ in range(reps)]
    _, pageable_s = timed(device, lambda: [t.to("cpu") for t in state_tensors(learner)])
    directory = root / "async.tmp"
    shutil.rmtree(directory, ignore_errors=True)
    directory.mkdir(parents=True)
    with warnings.catch_warnings():
        warnings.filterwarnings("ignore", "torch.distributed is disabled")
        _, write_s = timed(device, lambda: dcp.save(host, checkpoint_id=directory))
    t0 = time.perf_counter()
    fsync_tree(directory)
    fsync_s = time.perf_counter() - t0
    written, _ = tree_bytes(directory)
    shutil.rmtree(directory)
    copy_s = statistics.median(copies)
    return {"pinned_alloc_seconds": alloc_s, "d2h_bytes": copied, "d2h_pinned_seconds": copies,
            "d2h_pinned_gb_per_s": copied / copy_s / GB,
            "d2h_pageable_seconds": pageable_s, "d2h_pageable_gb_per_s": copied / pageable_s / GB,
            "background_write_seconds": write_s, "background_fsync_seconds": fsync_s,
            "background_bytes": written, "background_gb_per_s": written / (write_s + fsync_s) / GB,
            "step_stall_seconds": copy_s}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--device", default="cuda")
    parser.add_argument("--shape", default="qwen3-1.7b", help="qwen3-<shape> or a shared.modeling shape")
    parser.add_argument("--reps", type=int, default=3)
    parser.add_argument("--dir", default="data/bench-checkpoint",
                        help="where checkpoints are written (the trainer's data dir is ./data/trainer)")
    parser.add_argument("--disk-test-gb", type=float, default=0.0, help="0: 8 GB on cuda, 0.064 on cpu")
    parser.add_argument("--batch", type=int, default=2)
    parser.add_argument("--seq", type=int, default=128)
    parser.add_argument("--no-async", action="store_true", help="skip the asynchronous save's measurement")
    parser.add_argument("--drop-caches", action="store_true",
                        help="drop the host's whole page cache before cold reads (root, own machine)")
    parser.add_argument("--out-dir", default="", help="default bench/results")
    args = parser.parse_args()
    global DROP_CACHES
    DROP_CACHES = args.drop_caches
    run(args)


def run(args: argparse.Namespace) -> dict[str, Any]:
    device = torch.device(args.device)
    shape = shape_name(args.shape)
    card = card_name(device)
    out = Path(args.out_dir or RESULTS) / f"checkpoint-{card}.json"
    out.parent.mkdir(parents=True, exist_ok=True)
    root = Path(args.dir)
    root.mkdir(parents=True, exist_ok=True)
    result: dict[str, Any] = {
        "shape": shape, "card": card,
        "device": torch.cuda.get_device_name(device) if device.type == "cuda" else platform.machine(),
        "torch": torch.__version__, "host_cpus": os.cpu_count(), "file_system": file_system(root),
        "complete": False, "reps": [],
    }

    def write() -> None:
        tmp = out.with_suffix(".json.tmp")
        tmp.write_text(json.dumps(result, indent=1) + "\n")
        tmp.replace(out)

    model_dir = root / f"model-{shape}"
    _, result["make_model_dir_seconds"] = timed(device, lambda: make_model_dir(shape, model_dir, device))
    config = LearnerConfig.of(TrainerSettings(model=str(model_dir), device=args.device, data_dir=str(root)))
    learner, result["learner_init_seconds"] = timed(device, lambda: Learner(config, model_dir, pad_id=0))
    vocab = learner.model.config.vocab_size
    result["adam_loss"], result["adam_step_seconds"] = timed(
        device, lambda: adam_step(learner, vocab, args.batch, args.seq))
    tensors = state_tensors(learner)
    result["numel"] = sum(p.numel() for p in learner.model.parameters())
    result["state_bytes"] = nbytes(tensors)
    result["state_tensors"] = len(tensors)
    if device.type == "cuda":
        result["peak_gpu_gib"] = torch.cuda.max_memory_allocated(device) / 2**30
    print(f"{shape}: {result['numel'] / 1e9:.3f}B params, state {result['state_bytes'] / GB:.2f} GB",
          flush=True)
    write()

    size = int((args.disk_test_gb or (8.0 if device.type == "cuda" else 0.064)) * GB)
    result["disk"] = disk_bandwidth(root, size)
    print("disk", json.dumps(result["disk"]), flush=True)
    write()

    for rep in range(args.reps):
        adam_step(learner, vocab, args.batch, args.seq)  # each checkpoint of another state
        final, saved, row = save_like_trainer(learner, root, version=rep + 1)
        row["bytes"], row["files"] = tree_bytes(final)
        row["write_gb_per_s"] = row["bytes"] / (row["save_seconds"] + row["fsync_seconds"]) / GB
        perturb(learner)
        row["perturbed_differs"] = learner.state_checksum() != saved
        row["cache_evicted_by"] = drop_cache(final)
        _, row["load_seconds"] = timed(device, lambda: learner.load(final))  # noqa: B023
        loaded, row["load_checksum_seconds"] = timed(device, learner.state_checksum)
        row["checksums_equal"] = loaded == saved
        row["load_gb_per_s"] = row["bytes"] / row["load_seconds"] / GB
        if rep == args.reps - 1:  # once more from the page cache (a restart on the same host)
            perturb(learner)
            _, row["load_warm_seconds"] = timed(device, lambda: learner.load(final))  # noqa: B023
            row["load_warm_checksums_equal"] = learner.state_checksum() == saved
        shutil.rmtree(final)
        result["reps"].append(row)
        print("rep", rep, json.dumps(row), flush=True)
        write()

    rows = result["reps"]
    keys = [k for k, v in rows[0].items() if isinstance(v, float)] if rows else []
    result["median"] = {k: statistics.median(r[k] for r in rows) for k in keys if all(k in r for r in rows)}
    if rows:
        med = result["median"]
        bytes_ = rows[0]["bytes"]
        result["limits"] = {
            "disk_write_bound_seconds": bytes_ / (result["disk"]["write_gb_per_s"] * GB),
            "disk_read_bound_seconds": bytes_ / (result["disk"]["read_cold_gb_per_s"] * GB),
            "save_over_disk_bound": (med["save_seconds"] + med["fsync_seconds"])
            / (bytes_ / (result["disk"]["write_gb_per_s"] * GB)),
        }
    result["all_checksums_equal"] = all(r["checksums_equal"] and r["perturbed_differs"] for r in rows)
    write()

    if not args.no_async:
        result["async"] = asynchronous = async_alternative(learner, root, args.reps)
        result.setdefault("limits", {})["d2h_pinned_bound_seconds"] = asynchronous["step_stall_seconds"]
        print("async", json.dumps(asynchronous), flush=True)
    result["complete"] = True
    write()
    print(f"wrote {out}", flush=True)
    return result


if __name__ == "__main__":
    main()
