"""Sparse weight patch benchmark: `python -m bench.patch [--shape small] [--device cpu]`.

A Qwen3-shaped model (from config, no download) is trained with AdamW (lr 1e-6) on a real LM
loss over a text-like token stream; fp32 master weights, bf16 published weights. Per step it
records the changed fraction, dense bf16 bytes, patch bytes for `values`, `bitdelta`, `ctxans`, `auto`
and a PULSE-style baseline (grail's codec from PULSE, arXiv 2602.03839, re-implemented below), each
also as bits per changed weight beside the i.i.d. floor H(p)/p + 1 of the step's changed fraction p
(positions independent, a change costing its sign only); whether the
applied patch is bit-exact, and extract / encode / decode / apply / fingerprint seconds (extract and
fingerprint also through the per-tensor paths, as same-run baselines: `*_per_tensor_over_default`
is the speed-up of the default, batched on a GPU). After the
steps: union sparsity and merged patch size for k = 2, 4, 8 steps. JSON goes to
bench/results/patch-<device>.json, rewritten after every step (`complete` is false until the run
ends). `--save-patches DIR` writes the base snapshot and every step's
patch (the registry benchmark replays them).
"""

from __future__ import annotations

import argparse
import json
import math
import os
import platform
import statistics
import struct
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

import numpy as np
import torch
import zstandard
from transformers import Qwen3ForCausalLM

from shared.modeling import qwen3_config
from shared.patch import apply_patch, extract_patch, fingerprint, merge_patches, read_header, save_snapshot
from shared.patch.codec import (
    bits,
    changed_indices,
    changed_indices_and_fingerprint,
    compress,
    decode_patch,
    diff_states,
)
from shared.patch.fingerprint import device_sums
from shared.patch.format import parse_patch

StateDict = dict[str, torch.Tensor]
# Per shape: (batch, sequence length) of the training step.
_BATCH = {"tiny": (4, 64), "small": (4, 128), "0.6b": (8, 512), "1.7b": (8, 512)}
_MERGE_K = (2, 4, 8)


def text_like_tokens(vocab: int, n: int, rng: np.random.Generator) -> torch.Tensor:
    """Zipf-distributed tokens, about half of them inside repeated n-grams (phrases), like text."""
    p = np.arange(1, vocab + 1, dtype=np.float64) ** -1.1
    p /= p.sum()
    phrases = np.split(rng.choice(vocab, size=256 * 5, p=p), np.cumsum(rng.integers(2, 9, size=255)))
    phrase_p = np.arange(1, len(phrases) + 1, dtype=np.float64) ** -1.0
    phrase_p /= phrase_p.sum()
    singles = rng.choice(vocab, size=n, p=p)
    picks = rng.choice(len(phrases), size=n, p=phrase_p)
    out: list[np.ndarray] = []
    total = 0
    for i in range(n):  # pieces of 4 single tokens or one phrase, alternating at random
        piece = phrases[picks[i]] if rng.random() < 0.5 else singles[4 * (i % (n // 4 or 1)) :][:4]
        out.append(piece)
        total += piece.size
        if total >= n:
            break
    return torch.from_numpy(np.concatenate(out)[:n].astype(np.int64))


def pulse_baseline_bytes(old: StateDict, new: StateDict) -> int:
    """Bytes of grail's sparse delta codec (PULSE, arXiv 2602.03839, its public code): changed
    elements as COO sorted by (row, col), row = flat // prod(shape[1:]); rows diff-encoded, cols
    absolute at a row change and deltas within a row; each index array downcast to uint8 / uint16
    where its maximum fits (else int32); values as raw bits; a u32-length-prefixed JSON header
    with per-tensor offsets; zstd level 1 over the whole blob."""
    meta: list[dict[str, Any]] = []
    blobs: list[bytes] = []
    offset = 0
    for name in sorted(new):
        o, n = bits(old[name]), bits(new[name])
        flat = torch.nonzero(o != n).view(-1)
        if not flat.numel():
            continue
        cols_per_row = math.prod(new[name].shape[1:]) if new[name].dim() > 1 else 1
        rows, cols = (flat // cols_per_row).cpu().numpy(), (flat % cols_per_row).cpu().numpy()
        values = n[flat].cpu().numpy()
        row_delta = np.diff(rows, prepend=0)
        boundary = np.ones(rows.size, dtype=bool)
        boundary[1:] = row_delta[1:] != 0
        col_delta = np.where(boundary, cols, np.diff(cols, prepend=0))
        parts = [
            _downcast(row_delta, allow_uint8=True),
            _downcast(col_delta, allow_uint8=False),
            values.tobytes(),
        ]
        meta.append({"name": name, "shape": list(new[name].shape), "nnz": int(flat.numel()), "offset": offset,
                     "sizes": [len(b) for b in parts]})
        blobs += parts
        offset += sum(len(b) for b in parts)
    header = json.dumps({"version": 31, "tensors": meta}, separators=(",", ":")).encode()
    blob = struct.pack("<I", len(header)) + header + b"".join(blobs)
    return len(zstandard.ZstdCompressor(level=1, threads=-1).compress(blob))


def _downcast(a: np.ndarray, *, allow_uint8: bool) -> bytes:
    top = int(a.max())
    dtype = np.uint8 if allow_uint8 and top <= 0xFF else np.uint16 if top <= 0xFFFF else np.int32
    return a.astype(dtype).tobytes()


def _sync(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)


def timed(device: torch.device, fn: Callable[[], Any]) -> tuple[Any, float]:
    _sync(device)
    start = time.perf_counter()
    result = fn()
    _sync(device)
    return result, time.perf_counter() - start


def _extract_indices(old: StateDict, new: StateDict) -> int:
    """The extraction step alone: bitwise compare and changed positions of every tensor."""
    return sum(indices.numel() for indices in changed_indices(old, new).values())


def _encoding_sizes(old: StateDict, new: StateDict, header_bytes: int) -> dict[str, int]:
    """Patch bytes had every tensor used `values` (resp. `bitdelta`): one diff, both codings
    (header size taken from the `auto` patch; it differs by a few bytes)."""
    raws = diff_states(old, new, "auto")
    index = sum(len(compress(r.index_raw.numpy().tobytes())) for r in raws)
    return {
        "values": header_bytes + index + sum(len(compress(r.values_raw.numpy().tobytes())) for r in raws),
        "bitdelta": header_bytes + index + sum(len(compress(r.bitdelta_raw.numpy().tobytes())) for r in raws),
    }


def iid_floor_bits(p: float) -> float:
    """Bits per changed weight if each position changed independently with probability p and a
    change cost its sign only: H(p)/p + 1 (what a context-free coder cannot beat)."""
    if not 0 < p < 1:
        return 1.0
    return -(p * math.log2(p) + (1 - p) * math.log2(1 - p)) / p + 1


def _same_bits(a: StateDict, b: StateDict) -> bool:
    return all(torch.equal(bits(a[k]), bits(b[k])) for k in b)


def _device_name(device: torch.device) -> str:
    if device.type == "cuda":
        return torch.cuda.get_device_name(device)
    return f"{platform.processor() or platform.machine()} ({torch.get_num_threads()} threads)"


def output_path(args: argparse.Namespace) -> Path:
    return Path(args.out or f"bench/results/patch-{torch.device(args.device).type}.json")


def run(args: argparse.Namespace) -> dict[str, Any]:
    """Runs the steps; rewrites the JSON after every step, so a run cut short keeps its rows."""
    device = torch.device(args.device)
    out = output_path(args)
    out.parent.mkdir(parents=True, exist_ok=True)
    torch.manual_seed(args.seed)
    rng = np.random.default_rng(args.seed)
    config = qwen3_config(args.shape)
    batch, seq = args.batch or _BATCH[args.shape][0], args.seq or _BATCH[args.shape][1]
    model = Qwen3ForCausalLM(config).to(device)  # fp32 master weights
    optimizer = torch.optim.AdamW(model.parameters(), lr=args.lr, betas=(0.9, 0.98), weight_decay=0.1)
    autocast = (
        torch.autocast("cuda", dtype=torch.bfloat16)
        if device.type == "cuda"
        else torch.autocast("cpu", enabled=False)
    )

    def published() -> StateDict:  # named_parameters: tied embeddings appear once
        return {name: p.detach().to(torch.bfloat16) for name, p in model.named_parameters()}

    base = published()
    dense_bytes = sum(t.numel() * t.element_size() for t in base.values())
    params = sum(t.numel() for t in base.values())
    print(f"shape {args.shape}: {params / 1e6:.1f}M params, {dense_bytes / 1e6:.1f} MB bf16, device {device}")
    save_dir = Path(args.save_patches) if args.save_patches else None
    if save_dir:
        save_dir.mkdir(parents=True, exist_ok=True)
        (save_dir / "base.safetensors").write_bytes(save_snapshot(base, run=args.run, version=0))
    replica = {k: v.clone() for k, v in base.items()}
    old = base
    target_fp = ""
    steps: list[dict[str, Any]] = []
    patches: list[bytes] = []
    union: list[dict[str, Any]] = []
    for step in range(args.steps):
        tokens = text_like_tokens(config.vocab_size, batch * seq, rng).view(batch, seq).to(device)
        with autocast:
            loss = model(input_ids=tokens, labels=tokens).loss
        loss.backward()
        loss = loss.detach()
        optimizer.step()
        optimizer.zero_grad(set_to_none=True)
        new = published()

        changed, extract_s = timed(device, lambda o=old, n=new: _extract_indices(o, n))
        base_fp = target_fp if step else fingerprint(old)
        target_fp, fingerprint_s = timed(device, lambda n=new: fingerprint(n))
        # What extract_patch runs: both in one pass over the weights (fused on a GPU with Triton).
        (one_pass, one_pass_fp), extract_fingerprint_s = timed(
            device, lambda o=old, n=new: changed_indices_and_fingerprint(o, n))
        one_pass_exact = (
            one_pass_fp == target_fp
            and sum(i.numel() for i in one_pass.values()) == changed
            and all(
                torch.equal(i, j)
                for i, j in zip(one_pass.values(), changed_indices(old, new).values(), strict=True)
            )
        )
        del one_pass
        # Same-run baselines: the per-tensor paths (one reduction / one nonzero per tensor), the
        # default on a CPU and what a GPU ran before the batched paths.
        _, extract_per_tensor_s = timed(device, lambda o=old, n=new: changed_indices(o, n, batched=False))
        _, fingerprint_per_tensor_s = timed(
            device, lambda n=new: device_sums([n[k] for k in sorted(n)], stacked=False).cpu()
        )
        version = dict(run=args.run, base_version=step, target_version=step + 1,
                       base_fingerprint=base_fp, target_fingerprint=target_fp)
        patch, extract_encode_s = timed(
            device, lambda o=old, n=new, v=version: extract_patch(o, n, encoding="auto", **v))
        sizes = _encoding_sizes(old, new, header_bytes=read_header(patch).header_bytes)
        pulse = pulse_baseline_bytes(old, new)
        # ctxans alone, decoded and applied on its own copy of the base (same code as in `auto`).
        ctx_patch, ctx_extract_encode_s = timed(
            device, lambda o=old, n=new, v=version: extract_patch(o, n, encoding="ctxans", **v))
        ctx_header = parse_patch(ctx_patch)
        ctx_replica = {k: v.clone() for k, v in replica.items()}
        _, ctx_decode_s = timed(
            device, lambda p=ctx_patch, h=ctx_header, r=ctx_replica: decode_patch(p, h, r))
        apply_patch(ctx_replica, ctx_patch)
        ctx_exact = _same_bits(ctx_replica, new)
        del ctx_replica
        header = parse_patch(patch)
        _, decode_s = timed(device, lambda p=patch, h=header: decode_patch(p, h, replica))
        _, apply_s = timed(device, lambda p=patch: apply_patch(replica, p))
        bit_exact = _same_bits(replica, new)  # apply_patch has also checked the target fingerprint
        floor = iid_floor_bits(changed / params)
        per_change = {e: 8 * b / changed for e, b in (
            ("values", sizes["values"]), ("bitdelta", sizes["bitdelta"]), ("ctxans", len(ctx_patch)),
            ("auto", len(patch)), ("pulse", pulse))}
        record = {
            "step": step + 1,
            "loss": round(loss.item(), 4),
            "changed": changed,
            "changed_fraction": changed / params,
            "dense_bf16_bytes": dense_bytes,
            "values_bytes": sizes["values"],
            "bitdelta_bytes": sizes["bitdelta"],
            "ctxans_bytes": len(ctx_patch),
            "auto_bytes": len(patch),
            "auto_encodings": _encoding_counts(header),
            "auto_header_bytes": header.header_bytes,
            "iid_floor_bits_per_changed": floor,
            "bits_per_changed": per_change,
            "bits_over_iid_floor": {e: b / floor for e, b in per_change.items()},
            "ctxans_bit_exact": ctx_exact,
            "ctxans_encode_s": max(0.0, ctx_extract_encode_s - extract_s),
            "ctxans_decode_s": ctx_decode_s,
            "pulse_bytes": pulse,
            "bitdelta_over_pulse": sizes["bitdelta"] / pulse,
            "dense_over_auto": dense_bytes / len(patch),
            "bit_exact": bit_exact,
            "extract_s": extract_s,
            "fingerprint_s": fingerprint_s,
            "extract_fingerprint_s": extract_fingerprint_s,
            "extract_fingerprint_exact": one_pass_exact,
            "encode_s": max(0.0, extract_encode_s - extract_s),
            "extract_encode_s": extract_encode_s,
            "decode_s": decode_s,
            "apply_s": apply_s,
            "extract_per_tensor_s": extract_per_tensor_s,
            "fingerprint_per_tensor_s": fingerprint_per_tensor_s,
        }
        steps.append(record)
        patches.append(patch)
        if save_dir:
            (save_dir / f"patch-{step + 1:06d}.bin").write_bytes(patch)
        print(
            f"step {step + 1}: bits/changed weight ctxans {per_change['ctxans']:.2f} "
            f"auto {per_change['auto']:.2f} bitdelta {per_change['bitdelta']:.2f} "
            f"(i.i.d. floor {floor:.2f}; ctxans x{per_change['ctxans'] / floor:.3f}) "
            f"ctxans exact {ctx_exact} encode {record['ctxans_encode_s']:.3f} s decode {ctx_decode_s:.3f} s\n"
            f"  changed {record['changed_fraction']:.3%} values {sizes['values'] / 1e6:.2f} "
            "MB "
            f"bitdelta {sizes['bitdelta'] / 1e6:.2f} MB pulse {pulse / 1e6:.2f} MB "
            f"(x{record['bitdelta_over_pulse']:.2f}) exact {bit_exact} extract {extract_s * 1e3:.1f} ms "
            f"fp {fingerprint_s * 1e3:.1f} ms encode {record['encode_s']:.3f} s apply {apply_s:.3f} s"
        )
        if step + 1 in _MERGE_K:
            union.append(_union_record(base, new, patches, device, args.merge))
            print(f"  union of {step + 1} steps: {union[-1]['changed_fraction']:.3%} changed")
        partial = _report(args, device, params, dense_bytes, batch, seq, steps, union)
        out.write_text(json.dumps(partial | {"complete": False}, indent=1))
        old = new
    if save_dir:
        manifest = {"run": args.run, "shape": args.shape, "base": "base.safetensors",
                    "patches": [f"patch-{s['step']:06d}.bin" for s in steps]}
        (save_dir / "manifest.json").write_text(json.dumps(manifest, indent=1))
    result = _report(args, device, params, dense_bytes, batch, seq, steps, union) | {"complete": True}
    out.write_text(json.dumps(result, indent=1))
    return result


def _encoding_counts(header: Any) -> dict[str, int]:
    counts: dict[str, int] = {}
    for t in header.tensors:
        counts[t.encoding] = counts.get(t.encoding, 0) + 1
    return counts


def _union_record(
    base: StateDict, new: StateDict, patches: list[bytes], device: torch.device, merge: bool
) -> dict[str, Any]:
    k = len(patches)
    changed = _extract_indices(base, new)
    record: dict[str, Any] = {
        "k": k, "changed": changed, "changed_fraction": changed / sum(t.numel() for t in new.values()),
        "sum_of_step_patch_bytes": sum(len(p) for p in patches),
    }
    if merge:
        merged, merge_s = timed(device, lambda: merge_patches(patches, base))
        replica = {name: t.clone() for name, t in base.items()}
        apply_patch(replica, merged)
        record.update(merged_bytes=len(merged), merge_s=merge_s, merged_changed=read_header(merged).changed,
                      merged_bit_exact=_same_bits(replica, new))
    return record


def _report(args, device, params, dense_bytes, batch, seq, steps, union) -> dict[str, Any]:
    warm = steps[1:] or steps  # the first step also pays for allocator and thread-pool warm-up

    def med(key: str) -> float:
        return statistics.median(s[key] for s in warm)

    ratio = statistics.mean(s["bitdelta_over_pulse"] for s in steps)
    extract_fp = statistics.median(s["extract_s"] + s["fingerprint_s"] for s in warm)
    summary = {
        "torch_threads": torch.get_num_threads(),
        "max_ctxans_over_iid_floor": max(s["bits_over_iid_floor"]["ctxans"] for s in steps),
        "max_auto_over_iid_floor": max(s["bits_over_iid_floor"]["auto"] for s in steps),
        "ctxans_all_bit_exact": all(s["ctxans_bit_exact"] for s in steps),
        "median_ctxans_encode_s": med("ctxans_encode_s"), "median_ctxans_decode_s": med("ctxans_decode_s"),
        "mean_changed_fraction": statistics.mean(s["changed_fraction"] for s in steps),
        "mean_bitdelta_over_pulse": ratio,
        "mean_values_over_pulse": statistics.mean(s["values_bytes"] / s["pulse_bytes"] for s in steps),
        "mean_dense_over_auto": statistics.mean(s["dense_over_auto"] for s in steps),
        "all_bit_exact": all(s["bit_exact"] and s["extract_fingerprint_exact"] and s["ctxans_bit_exact"]
                             for s in steps)
        and all(u.get("merged_bit_exact", True) for u in union),
        "median_extract_fingerprint_one_pass_s": med("extract_fingerprint_s"),
        "median_extract_s": med("extract_s"), "median_fingerprint_s": med("fingerprint_s"),
        "median_extract_plus_fingerprint_s": extract_fp, "median_extract_encode_s": med("extract_encode_s"),
        "median_decode_s": med("decode_s"), "median_apply_s": med("apply_s"),
        "median_extract_per_tensor_s": med("extract_per_tensor_s"),
        "median_fingerprint_per_tensor_s": med("fingerprint_per_tensor_s"),
        "extract_per_tensor_over_default": med("extract_per_tensor_s") / med("extract_s"),
        "fingerprint_per_tensor_over_default": med("fingerprint_per_tensor_s") / med("fingerprint_s"),
    }
    targets = {
        "bitdelta_le_half_pulse": ratio <= 0.5,
        "extract_plus_fingerprint_le_30ms": extract_fp <= 0.030,
        "extract_fingerprint_one_pass_le_10ms": summary["median_extract_fingerprint_one_pass_s"] <= 0.010,
        "extract_encode_le_1s": summary["median_extract_encode_s"] <= 1.0,
        "apply_le_0_5s": summary["median_apply_s"] <= 0.5,
        "ctxans_le_0_85_iid_floor_every_step": summary["max_ctxans_over_iid_floor"] <= 0.85,
        "ctxans_encode_le_0_3s": summary["median_ctxans_encode_s"] <= 0.3,
        "ctxans_decode_le_0_3s": summary["median_ctxans_decode_s"] <= 0.3,
        "note": "timing targets are stated for the 1.7b shape on an H100-class GPU",
    }
    return {
        "bench": "patch", "device": device.type, "device_name": _device_name(device), "shape": args.shape,
        "params": params, "dense_bf16_bytes": dense_bytes, "steps": args.steps, "lr": args.lr, "batch": batch,
        "seq": seq, "seed": args.seed, "torch": torch.__version__,
        "cpu_count": os.cpu_count(), "loadavg_at_end": os.getloadavg(), "per_step": steps, "union": union,
        "summary": summary, "targets": targets,
    }


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--shape", default="small", choices=["tiny", "small", "0.6b", "1.7b"])
    parser.add_argument("--device", default="cpu")
    parser.add_argument("--steps", type=int, default=8)
    parser.add_argument("--lr", type=float, default=1e-6)
    parser.add_argument("--batch", type=int, default=0, help="default per shape")
    parser.add_argument("--seq", type=int, default=0, help="default per shape")
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--run", default="bench")
    parser.add_argument(
        "--no-merge", dest="merge", action="store_false", help="skip merge_patches for k=2,4,8"
    )
    parser.add_argument(
        "--save-patches", metavar="DIR", help="write base.safetensors + patch-NNNNNN.bin here"
    )
    parser.add_argument("--out", help="JSON path (default bench/results/patch-<device>.json)")
    args = parser.parse_args()
    if args.device == "cpu":
        torch.set_num_threads(max(1, min(4, torch.get_num_threads())))
    else:
        torch.backends.cuda.matmul.allow_tf32 = True
    result = run(args)
    print(json.dumps(result["summary"], indent=1))
    print(json.dumps(result["targets"], indent=1))
    print(f"wrote {output_path(args)}")


if __name__ == "__main__":
    main()
