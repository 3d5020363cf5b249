"""A patch chain of a model shape for `bench.wan`, prepared once on the CPU (untimed).

Training a 1.7B model on 2 CPU cores is out of reach, so the chain is synthetic at the measured
rate: step k moves bf16 elements by one unit in the last place, `flip_scale` times the changed
fraction that `bench.patch --shape 1.7b --device cuda` measured for its step k (bench/results/
patch-cuda-1.7b-h200.json). A one-ulp move is what a sub-ulp Adam step does to a bf16 copy (the
PULSE mechanism, arXiv 2602.03839); one-ulp deltas code a little smaller than real ones, so the
default scale (1.15) brings the patch bytes to the measured ones, which are written beside them.
Versions past the measured steps keep the last measured fraction (the fractions fall from step
to step, so those patches are if anything larger than a real run's).
Every patch is a real container (extract_patch), verified on publish.

Output folder:
    store/<run>/snapshots/0.safetensors, manifests/0.json   the registry store at v0
    store/<run>/merged/<v-2>-<v>.patch (+ .json)            lag-2 merged patches (endpoint diffs)
    patches/<v>.patch                                       v-1 → v, published live by the bench
    chain.json                                              sizes, fractions, timings
"""

from __future__ import annotations

import json
import time
from pathlib import Path
from typing import Any

import torch

from shared.patch import extract_patch, fingerprint, save_snapshot
from shared.registry.wire import Manifest, ObjectRef

MEASURED = "bench/results/patch-cuda-1.7b-h200.json"
PIECE_BYTES = 4 << 20  # the registry's default piece size (RegistrySettings.piece_bytes)


def _pieces(data: bytes | memoryview) -> list[str]:
    import hashlib

    view = memoryview(data)
    return [hashlib.sha256(view[i : i + PIECE_BYTES]).hexdigest() for i in range(0, len(view), PIECE_BYTES)]


def _ref(key: str, data: bytes) -> ObjectRef:
    return ObjectRef(key=key, size=len(data), piece_bytes=PIECE_BYTES, pieces=_pieces(data))


def shape_tensors(shape: str) -> dict[str, tuple[int, ...]]:
    """Parameter names and shapes of a Qwen3 shape (tied embeddings: published once)."""
    from transformers import Qwen3ForCausalLM

    from shared.modeling import qwen3_config

    with torch.device("meta"):
        model = Qwen3ForCausalLM(qwen3_config(shape))
    return {k: tuple(v.shape) for k, v in model.state_dict().items() if k != "lm_head.weight"}


def _flip(state: dict[str, torch.Tensor], fraction: float, gen: torch.Generator) -> dict[str, torch.Tensor]:
    new = {}
    for name, t in state.items():
        bits = t.view(torch.int16).clone()
        flat = bits.view(-1)
        n = flat.numel()
        count = int(round(n * fraction))
        idx = torch.randint(0, n, (count,), generator=gen)
        step = torch.randint(0, 2, (count,), generator=gen, dtype=torch.int16) * 2 - 1
        flat[idx] += step
        new[name] = bits.view(torch.bfloat16)
    return new


def prepare(folder: Path, shape: str, versions: int, run: str, seed: int = 0,
            flip_scale: float = 1.15) -> dict[str, Any]:
    measured = json.loads(Path(MEASURED).read_text())
    fractions = [s["changed_fraction"] * flip_scale for s in measured["per_step"]]
    measured_bytes: list[int | None] = [s["auto_bytes"] for s in measured["per_step"]]
    # Past the measured steps the last one's fraction holds (the measured fractions fall step
    # after step, so later patches are if anything smaller than these): ten versions and more.
    extra = max(0, versions - len(fractions))
    fractions += [fractions[-1]] * extra
    measured_bytes += [None] * extra
    store = folder / "store" / run
    for sub in ("snapshots", "manifests", "merged"):
        (store / sub).mkdir(parents=True, exist_ok=True)
    (folder / "patches").mkdir(parents=True, exist_ok=True)
    gen = torch.Generator().manual_seed(seed)
    t0 = time.perf_counter()
    state = {
        name: (torch.randn(dims, generator=gen) * 0.02).to(torch.bfloat16) if len(dims) > 1
        else torch.ones(dims, dtype=torch.bfloat16)
        for name, dims in shape_tensors(shape).items()
    }
    dense = sum(t.numel() * 2 for t in state.values())
    fp = fingerprint(state)
    snapshot = save_snapshot(state, run=run, version=0)
    (store / "snapshots" / "0.safetensors").write_bytes(snapshot)
    manifest = Manifest(
        run=run,
        version=0,
        fingerprint=fp,
        snapshot=_ref("snapshots/0.safetensors", snapshot),
        dense_bytes=dense,
        created_at=time.time(),
    )
    (store / "manifests" / "0.json").write_text(manifest.model_dump_json())
    del snapshot
    print(f"v0: {dense / 1e9:.2f} GB dense, {time.perf_counter() - t0:.0f} s", flush=True)
    history: list[dict[str, torch.Tensor]] = [state]
    fps = [fp]
    rows = []
    for v in range(1, versions + 1):
        t1 = time.perf_counter()
        new = _flip(history[-1], fractions[v - 1], gen)
        fps.append(fingerprint(new))
        patch = extract_patch(history[-1], new, run=run, base_version=v - 1, target_version=v,
                              base_fingerprint=fps[-2], target_fingerprint=fps[-1])
        (folder / "patches" / f"{v}.patch").write_bytes(patch)
        row: dict[str, Any] = {"version": v, "changed_fraction": fractions[v - 1], "patch_bytes": len(patch),
                               "measured_patch_bytes_h200": measured_bytes[v - 1]}
        if v >= 2:
            merged = extract_patch(history[-2], new, run=run, base_version=v - 2, target_version=v,
                                   base_fingerprint=fps[-3], target_fingerprint=fps[-1])
            key = f"merged/{v - 2}-{v}.patch"
            (store / key).write_bytes(merged)
            (store / "merged" / f"{v - 2}-{v}.json").write_text(_ref(key, merged).model_dump_json())
            row["merged_lag2_bytes"] = len(merged)
        row["seconds"] = round(time.perf_counter() - t1, 1)
        print(json.dumps(row), flush=True)
        rows.append(row)
        history = [*history[-1:], new]
    info = {
        "shape": shape,
        "run": run,
        "params": sum(t.numel() for t in state.values()),
        "dense_bytes": dense,
        "versions": rows,
        "synthetic": f"one-ulp flips at {flip_scale} x the changed fraction measured per "
        f"step on H200 ({MEASURED})",
        "prepare_seconds": round(time.perf_counter() - t0, 1),
    }
    (folder / "chain.json").write_text(json.dumps(info, indent=1))
    return info


if __name__ == "__main__":
    import argparse

    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("folder", type=Path)
    parser.add_argument("--shape", default="1.7b")
    parser.add_argument("--versions", type=int, default=6)
    parser.add_argument("--run", default="wan")
    args = parser.parse_args()
    torch.set_num_threads(1)
    prepare(args.folder, args.shape, args.versions, args.run)
